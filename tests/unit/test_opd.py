"""On-policy distillation's pieces with closed-form expectations: the reverse-KL term of the advantages
(slime/algorithm/opd.py) in both advantage entry points and the trainer's record, its metric in the loss, the
teacher log-probs from the rollout to the train batch, slime's two plugin functions on hand-written teacher
answers, and the --use-opd / --opd-* checks (slime's and ours)."""

from __future__ import annotations

import asyncio
import functools
import importlib.util

import pytest
import torch

from slime.algorithm.estimators import compute_advantages_and_returns_in_place
from slime.algorithm.loss import LossInputs, compute_actor_loss
from slime.algorithm.opd import apply_opd_kl_to_advantages, opd_advantages
from slime.backends.training.record import RolloutRecord, advantages_and_returns
from slime.config.arguments import SlimeArgumentError
from slime.rollout import on_policy_distillation as opd_plugin
from slime.rollout.train_data import build_train_batch
from slime.utils import ppo_utils as pu
from slime.utils.types import Sample, TrainBatch
from tests.args import make_args

STUDENT = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
TEACHER = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5])]  # reverse KL per token: [0.5, -1.0], [0.0]


def opd_args(*flags, **fields):
    return make_args("--use-opd", "--opd-type", "sglang", *flags, **fields)


def test_the_reverse_kl_is_subtracted_from_the_advantages():
    new, kl = opd_advantages([torch.tensor([1.0, 1.0]), torch.tensor([-2.0])], STUDENT, TEACHER, kl_coef=0.5)
    assert [x.tolist() for x in kl] == [[0.5, -1.0], [0.0]]
    assert [x.tolist() for x in new] == [[0.75, 1.5], [-2.0]]
    with pytest.raises(ValueError, match="sample 1 has 1 response tokens but 2 teacher log-probs"):
        opd_advantages([torch.zeros(2), torch.zeros(1)], STUDENT, [TEACHER[0], torch.zeros(2)], 1.0)


def test_slimes_apply_opd_kl_to_advantages_edits_in_place_and_stores_the_kl():
    args = opd_args("--opd-kl-coef", "2.0")
    advantages = [torch.zeros(2), torch.zeros(1)]
    data = {"teacher_log_probs": TEACHER}
    apply_opd_kl_to_advantages(args, data, advantages, STUDENT)
    assert [x.tolist() for x in advantages] == [[-1.0, 2.0], [0.0]]
    assert [x.tolist() for x in data["opd_reverse_kl"]] == [[0.5, -1.0], [0.0]]
    apply_opd_kl_to_advantages(args, {}, advantages, None)  # off the last pipeline stage: nothing to do
    with pytest.raises(ValueError, match="--opd-type sglang: the train batch has no teacher log-probs; .*reward_func"):
        apply_opd_kl_to_advantages(args, {}, advantages, STUDENT)


def test_slimes_dict_entry_point_adds_the_term_before_whitening():
    def rollout_data():
        return {"rewards": [1.0, -1.0], "response_lengths": [2, 1], "loss_masks": [torch.ones(2), torch.ones(1)],
                "log_probs": STUDENT, "teacher_log_probs": TEACHER}

    data = rollout_data()
    compute_advantages_and_returns_in_place(opd_args(), data)
    # grpo: the reward on every token, minus 1.0 × the reverse KL
    assert [x.tolist() for x in data["advantages"]] == [[0.5, 2.0], [-1.0]]
    assert [x.tolist() for x in data["opd_reverse_kl"]] == [[0.5, -1.0], [0.0]]
    whitened = rollout_data()
    compute_advantages_and_returns_in_place(opd_args(normalize_advantages=True), whitened)
    flat = torch.cat(whitened["advantages"])
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(flat, pu.masked_whiten(torch.tensor([0.5, 2.0, -1.0]), torch.ones(3)))


def test_the_trainers_record_gets_the_term_and_keeps_the_kl_for_the_metric():
    batch = TrainBatch(tokens=[[5, 6, 7, 8], [5, 9]], response_lengths=[2, 1], loss_masks=[[1, 1], [1]],
                       rewards=[1.0, -1.0], raw_rewards=[1.0, 0.0], truncated=[False, False], group_indices=[0, 1])
    record = RolloutRecord(batch, [[[0, 1]]])
    record.loss_masks = {r: torch.tensor(batch.loss_masks[r], dtype=torch.float32) for r in (0, 1)}
    record.old_log_probs = dict(enumerate(STUDENT))
    record.teacher_log_probs = dict(enumerate(TEACHER))
    advantages_and_returns(opd_args("--opd-kl-coef", "0.5"), record, None, "cpu")
    assert {r: a.tolist() for r, a in record.advantages.items()} == {0: [0.75, 1.5], 1: [-1.0]}
    assert {r: k.tolist() for r, k in record.opd_reverse_kl.items()} == {0: [0.5, -1.0], 1: [0.0]}
    record.teacher_log_probs = None
    with pytest.raises(ValueError, match="no teacher log-probs"):
        advantages_and_returns(opd_args(), record, None, "cpu")


def test_the_loss_reports_the_reverse_kl_like_its_other_terms():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 1.0]])).requires_grad_(True)
    inputs = LossInputs(
        log_probs=logp, old_log_probs=logp.detach().clone(), advantages=torch.zeros(2, 2), mask=mask,
        entropy=torch.zeros(2, 2), global_denominator=2.0,
        aggregate=functools.partial(pu.aggregate_loss, mask=mask, per_token=False, global_denominator=2.0),
        opd_reverse_kl=torch.tensor([[0.5, -1.0], [0.0, 9.0]]),  # 9.0: a padded position, masked out
    )
    _, metrics = compute_actor_loss(make_args(), inputs)
    assert metrics["train/opd_reverse_kl"].item() == pytest.approx(((0.5 - 1.0) / 2 + 0.0) / 2)
    _, plain = compute_actor_loss(make_args(), LossInputs(**{**inputs.__dict__, "opd_reverse_kl": None}))
    assert "train/opd_reverse_kl" not in plain


# ---- the rollout side --------------------------------------------------------------------------------------------
def sample(index: int, tokens: list[int], response: int, **kw) -> Sample:
    return Sample(index=index, group_index=index, tokens=tokens, response_length=response,
                  status=Sample.Status.COMPLETED, **kw)


def teacher_answer(tokens: list[int], log_probs: list[float]) -> dict:
    """An SGLang /generate answer scoring `tokens` from position 0 (its first entry has no prediction)."""
    entries = [[None, tokens[0], None]] + [[lp, t, None] for lp, t in zip(log_probs, tokens[1:])]
    return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries}}


def test_reward_func_asks_the_teacher_to_score_the_sequence_as_slime_does():
    """slime's request, whatever --rollout-temperature: the temperature does not change prompt log-probs (SGLang's
    or the hf engine's), so the teacher's are its own distribution."""
    args = opd_args(rollout_temperature=0.7, rm_url="http://teacher/generate")
    payload = opd_plugin.teacher_payload(args, sample(0, [5, 6, 7], 1))
    assert payload == {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}}
    with pytest.raises(ValueError, match="set --rm-url"):
        asyncio.run(opd_plugin.reward_func(opd_args(), sample(0, [5, 6], 1)))


def test_post_process_takes_the_response_tokens_log_probs_and_returns_zero_rewards():
    args = opd_args(rm_url="http://teacher/generate")
    a = sample(0, [5, 6, 7, 8], 2, reward=teacher_answer([5, 6, 7, 8], [-0.1, -0.2, -0.3]))
    failed = sample(1, [5, 6, 7], 1, reward=0.0)
    failed.status = Sample.Status.FAILED
    raw, rewards = opd_plugin.post_process_rewards(args, [a, failed])
    assert (raw, rewards) == ([0.0, 0.0], [0.0, 0.0])
    assert a.teacher_log_probs == [-0.2, -0.3] and failed.teacher_log_probs == [0.0]
    # through the train batch: the plugins' rewards replace the dict rewards, the teacher log-probs ride along
    args = opd_args("--global-batch-size", "2", rm_url="http://teacher/generate", n_samples_per_prompt=1,
                    custom_reward_post_process_path="slime.rollout.on_policy_distillation.post_process_rewards")
    b = sample(2, [5, 6, 7, 8], 2, reward=teacher_answer([5, 6, 7, 8], [-1.0, -2.0, -3.0]))
    batch = build_train_batch(args, [b])
    assert batch.teacher_log_probs == [[-2.0, -3.0]] and batch.raw_rewards == [0.0] and batch.rewards == [0.0]


@pytest.mark.parametrize("tokens, reported", [
    ([5, 6, 191, 7, 8], [5, 6, 0, 7, 8]),  # the tiny models' last id (vocab_size 192): SGLang reports 0
    ([191, 5, 6, 191, 0], [0, 5, 6, 0, 0]),
    ([5, 6, 191, 7, 8], [5, 6, 191, 7, 8]),  # a teacher with a larger vocabulary reports it as itself
])
def test_sglangs_answer_for_the_last_vocabulary_id_is_accepted(tokens, reported):
    """SGLang 0.5.16 reports an input id >= vocab_size - 1 as 0 (the log-prob is still the sent token's): seen
    with a random-init student on the H200, whose samples hold any id of its padded vocabulary."""
    s = sample(0, tokens, 3, reward=teacher_answer(reported, [-0.1, -0.2, -0.3, -0.4]))
    opd_plugin.post_process_rewards(opd_args(rm_url="http://t/generate"), [s])
    assert s.teacher_log_probs == [-0.2, -0.3, -0.4]


SCORED_OTHER = "scored other tokens than the sample's: position"


@pytest.mark.parametrize("answer, message", [
    ({"text": "4"}, r"answered without meta_info.input_token_logprobs \(\['text'\]\)"),
    (teacher_answer([5, 6, 7], [-0.1, -0.2]), "returned 3 input log-probs for 4 tokens"),
    (teacher_answer([5, 9, 7, 8], [-0.1, -0.2, -0.3]),  # other input_ids
     f"{SCORED_OTHER} 1: the sample has id 6, the teacher reported id 9; the teacher must score the input_ids as "
     "sent"),
    (teacher_answer([6, 7, 8, 3], [-0.1, -0.2, -0.3]),  # one token dropped at the front
     f"{SCORED_OTHER} 0: the sample has id 5, the teacher reported id 6: its ids are the sample's shifted by "
     "\\+1 position"),
    (teacher_answer([9, 5, 6, 7], [-0.1, -0.2, -0.3]),  # one token too many at the front
     f"{SCORED_OTHER} 0: the sample has id 5, the teacher reported id 9: its ids are the sample's shifted by -1"),
    (teacher_answer([5, 6, 12, 13], [-0.1, -0.2, -0.3]),  # another response
     f"{SCORED_OTHER} 2: the sample has id 7, the teacher reported id 12; the teacher must score"),
    (teacher_answer([5, 0, 7, 8], [-0.1, -0.2, -0.3]),  # 0 for 6, not the largest id
     f"{SCORED_OTHER} 1: the sample has id 6, the teacher reported id 0; SGLang reports 0 only in place of its "
     "vocab_size - 1, which is at least the sample's largest id 8 for a teacher that can score it"),
    (teacher_answer([5, 6, 0, 0], [-0.1, -0.2, -0.3]),  # a teacher of vocab_size 7 cannot score 7 and 8
     f"{SCORED_OTHER} 2: the sample has id 7, .* or has a smaller vocabulary than the student"),
    (teacher_answer([0, 0, 0, 0], [-0.1, -0.2, -0.3]),
     f"{SCORED_OTHER} 0: the sample has id 5, the teacher reported id 0"),
])  # fmt: skip
def test_a_wrong_teacher_answer_names_the_sample_and_the_server(answer, message):
    s = sample(3, [5, 6, 7, 8], 2, reward=answer)
    with pytest.raises(ValueError, match=f"sample 3: the teacher at http://t/generate {message}"):
        opd_plugin.post_process_rewards(opd_args(rm_url="http://t/generate"), [s])


def test_the_largest_id_reported_as_0_and_as_itself_is_refused():
    s = sample(3, [5, 8, 7, 8], 2, reward=teacher_answer([5, 0, 7, 8], [-0.1, -0.2, -0.3]))
    with pytest.raises(ValueError, match=f"{SCORED_OTHER} 1: the sample has id 8, the teacher reported id 0, yet id 8 "
                                         "as itself at position 3: it was given other input_ids"):
        opd_plugin.post_process_rewards(opd_args(rm_url="http://t/generate"), [s])


def test_teacher_log_probs_must_cover_every_sample_and_response_token():
    args = make_args()
    ok = sample(0, [5, 6, 7], 2, reward=1.0, teacher_log_probs=[-1.0, -2.0])
    assert build_train_batch(args, [ok, sample(1, [5, 6], 1, reward=0.0, teacher_log_probs=torch.tensor([-3.0]))]
                             ).teacher_log_probs == [[-1.0, -2.0], [-3.0]]
    assert build_train_batch(args, [sample(0, [5, 6], 1, reward=1.0)] * 2).teacher_log_probs is None
    with pytest.raises(ValueError, match=r"samples \[1\] have no teacher_log_probs but others do"):
        build_train_batch(args, [ok, sample(1, [5, 6], 1, reward=0.0)])
    with pytest.raises(ValueError, match="sample 1: teacher_log_probs has 2 entries, response_length=1"):
        build_train_batch(args, [ok, sample(1, [5, 6], 1, reward=0.0, teacher_log_probs=[-1.0, -2.0])])


# ---- flags ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--use-opd"], "--use-opd needs --opd-type: sglang"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/nowhere/teacher"],
     "--opd-teacher-load /nowhere/teacher: no such checkpoint folder"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "TEACHER"], "with --opd-type sglang: the teacher's"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-ckpt-step", "3"],
     "--opd-teacher-ckpt-step 3 with --opd-type sglang"),
    (["--opd-teacher-load", "TEACHER"], "is set but --use-opd is not"),
    (["--opd-type", "sglang"], "--opd-type configures on-policy distillation, which is off"),
    (["--use-opd", "--opd-type", "sglang", "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"],
     "posts every sample to the teacher server: add --rm-url"),
    (["--use-opd", "--opd-type", "sglang", "--loss-type", "sft_loss"], "the SFT loss reads no advantages"),
    (["--use-opd", "--opd-type", "sglang", "--loss-type", "custom_loss", "--custom-loss-function-path", "m.f",
      "--disable-compute-advantages-and-returns"], "the teacher's KL enters through the advantages"),
])  # fmt: skip
def test_opd_flag_checks(tmp_path, flags, message):
    flags = [str(tmp_path) if f == "TEACHER" else f for f in flags]
    with pytest.raises(SlimeArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_args(*flags)


def test_opd_flags_parse_as_slime(tmp_path):
    args = make_args("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path),
                     "--opd-teacher-ckpt-step", "7", "--opd-kl-coef", "0.5")
    assert (args.use_opd, args.opd_type, args.opd_teacher_load, args.opd_teacher_ckpt_step, args.opd_kl_coef) == (
        True, "megatron", str(tmp_path), 7, 0.5)
    assert make_args().opd_kl_coef == 1.0 and make_args().use_opd is False


# ---- where the trainer-held teacher is loaded from ------------------------------------------------------------
def _iteration(root, step: int, files: tuple[str, ...]) -> None:
    folder = root / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("{}")


def test_fsdp_teacher_folder_hf_or_an_fsdp_checkpoint_iteration(tmp_path):
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    def folder(load, step=None):
        return FSDPTrainRayActor._teacher_folder(make_args(validate=False, opd_teacher_load=str(load),
                                                           opd_teacher_ckpt_step=step))

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert folder(hf) == str(hf)
    ckpt = tmp_path / "ckpt"
    for step in (3, 7):
        _iteration(ckpt, step, ("config.json", "model.safetensors"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    assert folder(ckpt) == str(ckpt / "iter_0000007") and folder(ckpt, 3) == str(ckpt / "iter_0000003")
    with pytest.raises(FileNotFoundError, match=r"--opd-teacher-ckpt-step 5: .* \(complete ones: \[3, 7\]\)"):
        folder(ckpt, 5)
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        folder(tmp_path / "empty")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_megatron_teacher_source_torch_dist_at_a_step_or_hf(tmp_path):
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    def source(load, step=None):
        return MegatronTrainRayActor._teacher_source(make_args(validate=False, opd_teacher_load=str(load),
                                                               opd_teacher_ckpt_step=step))

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert source(hf) == (None, str(hf))
    ckpt = tmp_path / "ckpt"
    for step in (2, 4):
        _iteration(ckpt, step, ("metadata.json",))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    latest, _ = source(ckpt)
    assert (latest.path, latest.iteration) == (str(ckpt / "iter_0000004"), 4)
    picked, _ = source(ckpt, 2)
    assert (picked.path, picked.iteration) == (str(ckpt / "iter_0000002"), 2)
    with pytest.raises(FileNotFoundError, match=r"--opd-teacher-ckpt-step 3: .* \(complete iterations: \[2, 4\]\)"):
        source(ckpt, 3)


def test_a_reward_post_process_must_return_slimes_pair(tmp_path):
    plugin = tmp_path / "bad_post.py"
    plugin.write_text("def post(args, samples):\n    return [0.0] * len(samples)\n")
    args = make_args("--global-batch-size", "2", n_samples_per_prompt=1, custom_reward_post_process_path=f"{plugin}:post")
    with pytest.raises(ValueError, match=r"bad_post.py:post: slime's contract returns \(raw_rewards, rewards\), one "
                                         r"entry per sample \(2\); got list"):
        build_train_batch(args, [sample(0, [5, 6], 1, reward=1.0), sample(1, [5, 7], 1, reward=0.0)])
