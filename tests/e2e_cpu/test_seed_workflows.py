"""The seed document's three launch commands (docs: ../shared/seed, steps 3, 5 and 6) on CPU, with the tiny
Qwen3 and smaller numbers substituted: their flags as written, plus what a CPU run needs (one training rank,
one hf engine, a few rollouts, short responses) and a reward type (the document's command names none; the
run stops before Ray without one). Each runs in a fresh working directory with no logging or checkpoint
folder given, so it also shows that `tensorboard --logdir outputs/` finds the run and that checkpoints land
under outputs/.

- step 3, standard GRPO (`train.py`): chat-format data with a system prompt (`--apply-chat-template`),
  `--use-kl-loss --kl-loss-coef 0.001`, `--save-interval`, `--eval-interval`, `${MODEL_ARGS[@]}`;
- step 5, async (`train_async.py --async-buffer-size 4 --update-weights-interval 2`): weights pushed every
  second rollout, the staleness logged;
- step 6, multi-turn (`--custom-generate-function-path custom_generate.py --max-turns 5`): a user's file
  whose `custom_generate` loops generate → tool → append the tool message → generate, bounded by
  --max-turns; the turn counts logged with --log-multi-turn.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT, model_args
from tests.e2e_cpu.test_train_async import _left_over, _marked_env
from tests.e2e_cpu.together import result_of, run_together

# Step 1's chat form: a system prompt and a user message per row.
CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "你是一个数学导师。"},
                {"role": "user", "content": f"{a} + {b} 是多少？"}], "label": str(a + b)}
    for a in range(4) for b in range(4)
]  # fmt: skip

CUSTOM_GENERATE = '''
from slime.rollout.multi_turn import append_tool_tokens, generate_turn, render_tool_message, turn_budget_left
from slime.rollout.sglang_rollout import get_tokenizer


def word_count_tool(text: str) -> str:
    return f"{len(text.split())} words"


async def custom_generate(args, sample, sampling_params):
    """generate -> extract the tool call -> run the tool -> append its result -> generate again, until
    --max-turns. Every turn counts as a call here (a random tiny model writes no call syntax)."""
    tokenizer = get_tokenizer(args)
    turns = 0
    while turn_budget_left(args, sample, turns):
        text = await generate_turn(args, sample, sampling_params)
        turns += 1
        if sample.status == sample.Status.ABORTED or not turn_budget_left(args, sample, turns):
            break
        result = render_tool_message(tokenizer, word_count_tool(text), last_token=sample.tokens[-1])
        append_tool_tokens(sample, tokenizer, result)
    sample.metadata = {**(sample.metadata or {}), "turns": turns, "tool_calls": turns - 1}
    return sample
'''


def run_in(cwd, script: str, model_dir: str, *flags: str) -> None:
    env, marker = _marked_env()
    cmd = [sys.executable, os.path.join(REPO_ROOT, script), "--hf-checkpoint", model_dir, *flags,
           "--rm-type", "math", *model_args("tiny-qwen3")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=str(cwd))
    assert out.returncode == 0, out.stderr[-4000:]
    assert _left_over(marker) == {}


def the_run(cwd, kind: str) -> str:
    """The one run folder under outputs/<kind>/slime/ (the run name is its start time)."""
    found = glob.glob(os.path.join(str(cwd), "outputs", kind, "slime", "*"))
    assert len(found) == 1, found
    return found[0]


def make_workdir(path):
    path.mkdir()
    with open(path / "train.jsonl", "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in CHAT_ROWS)
    return path


SMALL = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
         "--rollout-max-response-len", "8"]  # fmt: skip


# Each step's command (script, flags); the three run two at a time, each in its own working directory
# (tests/e2e_cpu/together.py), and each test checks its own run.
STEPS = {
    "step3": ("train.py", [*SMALL,
              "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001",
              "--prompt-data", "train.jsonl", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
              "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
              "--num-rollout", "3", "--save-interval", "2", "--eval-interval", "2",
              "--eval-prompt-data", "aime", "train.jsonl@[0:4]", "gsm8k", "train.jsonl@[4:12]"]),
    "step5": ("train_async.py", [*SMALL,
              "--advantage-estimator", "grpo", "--async-buffer-size", "4", "--update-weights-interval", "2",
              "--prompt-data", "train.jsonl", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
              "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
              "--num-rollout", "4"]),
    "step6": ("train.py", [*SMALL,
              "--custom-generate-function-path", "custom_generate.py", "--max-turns", "5",
              "--prompt-data", "train.jsonl", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
              "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
              "--num-rollout", "2", "--log-multi-turn",
              "--save-debug-rollout-data", "dump/rollout_{rollout_id}.pt"]),
}  # fmt: skip


def run_step(root, tiny_model_dir, step: str):
    workdir = make_workdir(root / step)
    if step == "step6":
        (workdir / "custom_generate.py").write_text(CUSTOM_GENERATE)
    script, flags = STEPS[step]
    run_in(workdir, script, tiny_model_dir, *flags)
    return workdir


@pytest.fixture(scope="module")
def step_runs(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("seed")
    return run_together(lambda step: run_step(root, tiny_model_dir, step), STEPS)


@pytest.mark.timeout(600)
def test_step3_standard_grpo(step_runs):
    workdir = result_of(step_runs, "step3")
    tb = the_run(workdir, "tensorboard")
    assert sorted(read_scalars(tb, "rollout/raw_reward")) == [0, 1, 2]
    # step 3's scenario two: several eval sets, each logged under its name
    aime, gsm8k = read_scalars(tb, "eval/aime"), read_scalars(tb, "eval/gsm8k")
    assert aime and sorted(aime) == sorted(gsm8k), (aime, gsm8k)
    # GRPO's first-step invariants (the other estimators: test_algorithms_e2e.py): ppo_kl is 0 (the old-policy
    # pass repeats the training forward), the KL to the reference is 0 (it starts as the policy; a second
    # model instance, so fp32 rounding ~4e-8), and the trainer's log-probs match the engine's.
    ppo_kl, kl = read_scalars(tb, "train/ppo_kl"), read_scalars(tb, "train/kl_loss")
    assert sorted(ppo_kl) == sorted(kl) == [0, 1, 2] and abs(ppo_kl[0]) < 1e-8 and abs(kl[0]) < 1e-6
    assert all(v < 1e-3 for v in read_scalars(tb, "train/train_rollout_logprob_abs_diff").values())
    ckpt = the_run(workdir, "checkpoints")
    assert os.path.basename(ckpt) == os.path.basename(tb)  # one run name for both
    # --save-interval 2 saves after rollout 1; the last rollout (2) is always saved.
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000001", "iter_0000002"]


@pytest.mark.timeout(600)
def test_step5_async(step_runs):
    workdir = result_of(step_runs, "step5")
    tb = the_run(workdir, "tensorboard")
    assert sorted(read_scalars(tb, "rollout/raw_reward")) == [0, 1, 2, 3]
    assert sorted(read_scalars(tb, "perf/update_weights_time")) == [1, 3]  # every second rollout
    lag = read_scalars(tb, "rollout/weight_version_lag/max")
    assert sorted(lag) == [0, 1, 2, 3] and max(lag.values()) >= 1  # generated ahead of the newest weights


@pytest.mark.timeout(600)
def test_step6_multi_turn_custom_generate_file(step_runs):
    workdir = result_of(step_runs, "step6")
    tb = the_run(workdir, "tensorboard")
    turns = read_scalars(tb, "rollout/multi_turn/turns_max")
    assert sorted(turns) == [0, 1] and set(turns.values()) == {5.0}  # --max-turns bounds the loop
    assert set(read_scalars(tb, "rollout/multi_turn/tool_calls_max").values()) == {4.0}
    import torch

    samples = torch.load(workdir / "dump" / "rollout_1.pt", weights_only=False)["samples"]
    for s in samples:  # model tokens trainable, the tool messages between turns not
        mask = s["loss_mask"]
        assert len(mask) == s["response_length"] == len(s["rollout_log_probs"])
        assert 1 in mask and 0 in mask and mask[0] == 1
