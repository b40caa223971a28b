"""slime's SFT rollout (slime.rollout.sft_rollout) on the real data source and test tokenizer, its errors, and the
flags of slime's SFT script that act on both trainers: --num-epoch's rollout count and --lr-warmup-fraction with
the fsdp backend's schedule, which follows megatron-core's OptimizerParamScheduler step for step."""

from __future__ import annotations

import importlib.util
import json

import pytest

from slime.backends.fsdp_utils.parallel import lr_at
from slime.config.arguments import SlimeArgumentError
from slime.rollout import sft_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.train_data import flatten_groups, samples_to_train_batch
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from tests.args import make_args

CONVERSATION = [{"role": "user", "content": "what comes after 3 ?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and then ?"}, {"role": "assistant", "content": "5"}]


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return str(path)


def sft_args(tokenizer_dir, data, *flags, **fields):
    return make_args("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--prompt-data", data,
                     "--input-key", "messages", "--n-samples-per-prompt", "1", "--global-batch-size", "2",
                     "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns", *flags,
                     hf_checkpoint=tokenizer_dir, **fields)


def test_a_rollout_is_the_next_conversations_rendered_and_masked(tokenizer_dir, tmp_path):
    rows = [CONVERSATION, [{"role": "system", "content": "you are helpful"}] + CONVERSATION[:2], CONVERSATION[2:]]
    args = sft_args(tokenizer_dir, write_rows(tmp_path / "sft.jsonl", rows))
    source = RolloutDataSourceWithBuffer(args)
    groups = sft_rollout.generate_rollout(args, 0, source)
    assert [len(g) for g in groups] == [1, 1] and source.sample_offset == 2
    generator = MultiTurnLossMaskGenerator(sft_rollout.mask_generator(args).tokenizer, "qwen")
    for group, messages in zip(groups, rows):
        s = group[0]
        ids, mask = generator.get_loss_mask(messages)
        assert s.tokens == ids and s.response_length == len(mask) - mask.index(1) and s.reward == 0
        assert s.loss_mask == mask[-s.response_length:]
    first = groups[0][0]
    # the response starts at the first answer; the second user turn inside it is not trained on
    assert sum(first.loss_mask) == 4 and first.loss_mask[:2] == [1, 1] and 0 in first.loss_mask
    batch = samples_to_train_batch(args, flatten_groups(groups, args.rollout_function_path))
    assert batch.loss_masks == [g[0].loss_mask for g in groups] and batch.rewards == [0.0, 0.0]
    # the next rollout wraps into the second epoch: the third row, then the first again
    again = sft_rollout.generate_rollout(args, 1, source)
    assert [g[0].prompt for g in again] == [rows[2], rows[0]] and source.epoch_id == 1


def test_rows_without_anything_to_train_on_and_other_misuse_are_named(tokenizer_dir, tmp_path):
    args = sft_args(tokenizer_dir, write_rows(tmp_path / "sft.jsonl", [CONVERSATION] * 2))
    source = RolloutDataSourceWithBuffer(args)
    with pytest.raises(ValueError, match="has no evaluation rollout"):
        sft_rollout.generate_rollout(args, 0, source, evaluation=True)
    with pytest.raises(ValueError, match="--n-samples-per-prompt 2: slime.rollout.sft_rollout trains each"):
        sft_rollout.generate_rollout(sft_args(tokenizer_dir, str(tmp_path / "sft.jsonl"), "--n-samples-per-prompt",
                                              "2", "--global-batch-size", "4"), 0, source)
    silent = [dict(m, step_loss_mask=0) if m["role"] == "assistant" else m for m in CONVERSATION]
    args = sft_args(tokenizer_dir, write_rows(tmp_path / "silent.jsonl", [silent, CONVERSATION]))
    with pytest.raises(ValueError, match="sample 0: nothing to train on with --loss-mask-type qwen"):
        sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    args = sft_args(tokenizer_dir, write_rows(tmp_path / "text.jsonl", [CONVERSATION] * 2), "--apply-chat-template")
    with pytest.raises(ValueError, match="needs chat messages .* do not pass --apply-chat-template"):
        sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_loss_mask_type_is_a_real_flag_with_slimes_choices(tokenizer_dir, tmp_path):
    data = write_rows(tmp_path / "sft.jsonl", [CONVERSATION])
    assert sft_args(tokenizer_dir, data).loss_mask_type == "qwen"
    assert sft_args(tokenizer_dir, data, "--loss-mask-type", "qwen3_5").loss_mask_type == "qwen3_5"
    with pytest.raises(SlimeArgumentError, match="--loss-mask-type"):
        sft_args(tokenizer_dir, data, "--loss-mask-type", "llama3")


def test_num_epoch_needs_the_global_dataset():
    with pytest.raises(SlimeArgumentError, match="--num-epoch 2 counts epochs of --prompt-data, which "
                                                 "--disable-rollout-global-dataset does not load"):
        make_args("--num-epoch", "2", "--disable-rollout-global-dataset", num_rollout=None)


# ---- the learning-rate schedule on fsdp -----------------------------------------------------------------------
def test_lr_warmup_fraction_is_checked_for_every_backend():
    with pytest.raises(SlimeArgumentError, match="give one warm-up length"):
        make_args("--train-backend", "fsdp", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2")
    with pytest.raises(SlimeArgumentError, match=r"must lie in \[0, 1\)"):
        make_args("--train-backend", "fsdp", "--lr-warmup-fraction", "1.5")
    args = make_args("--train-backend", "fsdp", "--lr-warmup-fraction", "0.1")
    assert "--lr-warmup-fraction" not in args.megatron_args  # a training flag fsdp reads, not a Megatron-only one


def test_fsdp_schedule_closed_form():
    args = make_args("--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", "linear", "--lr-warmup-fraction", "0.25")
    # 8 steps: warm-up over 2 steps from 0 (step 0 runs at --lr-warmup-init), then linear to 0.1 at step 8
    got = [lr_at(args, k, total_steps=8) for k in range(10)]
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1, 0.1])


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.parametrize("flags", [
    ("--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1"),
    ("--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.3", "--lr-decay-iters", "12"),
    ("--lr-decay-style", "linear", "--lr-warmup-iters", "3", "--lr-warmup-init", "1e-4"),
    ("--lr-decay-style", "constant", "--lr-warmup-iters", "2"),
    ("--lr-decay-style", "cosine",),
])  # fmt: skip
def test_fsdp_schedule_matches_megatron_cores_scheduler(flags):
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from slime.backends.megatron_utils.args import lr_scheduler_kwargs

    args = make_args("--lr", "3e-3", "--min-lr", "3e-4", *flags)
    total = 20
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    optimizer.param_groups[0].update(max_lr=args.lr, min_lr=args.min_lr)
    scheduler = OptimizerParamScheduler(optimizer, **lr_scheduler_kwargs(args, total))
    for step in range(total + 3):
        assert lr_at(args, step, total) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        scheduler.step(increment=1)
