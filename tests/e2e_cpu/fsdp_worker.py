"""One training rank for tests/e2e_cpu/test_fsdp_actor.py (run as a plain process, one per rank).

It drives `FSDPTrainRayActor` directly (no Ray: the rank processes are started by the test) over a real
gloo process group, and rank 0 writes what it saw to <out>/result.json:
  every world size: init -> log-probs -> one train step (one optimizer step) -> log-probs, with the forward-only
    log-prob passes it ran;
  1 rank: also gspo + --calculate-per-token-loss + --entropy-coef, then --use-rollout-logprobs;
  --dynamic: micro-batches by token budget (ranks then hold different splits, equalised in count);
  --full: also save -> load into a second actor (+ a third one without the optimizer state) -> train all
          on a two-step batch; the saved folder read back with plain `from_pretrained`; and, with an
          `hf` engine server started by rank 0, a weight push checked against the engine's log-probs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch

from slime.utils.ppo_utils import group_normalize_rewards
from tests.args import make_args as validated_args
from tests.e2e_cpu.ranks import worker_parser, write_result
from slime.utils.types import TrainBatch

TEMPERATURE = 1.0


def make_args(model_dir: str, out_dir: str, backend: str = "gloo", argv: tuple[str, ...] = (),
              **overrides) -> argparse.Namespace:
    """Validated args of one rollout of 8 samples (4 prompts x 2) in one optimizer step, with a KL loss against
    the reference model; `argv` more flags, `overrides` set before validation."""
    return validated_args(*argv, **{
        "hf_checkpoint": model_dir, "save": os.path.join(out_dir, "ckpt"), "distributed_backend": backend,
        "distributed_timeout_minutes": 5, "lr": 1e-3, "weight_decay": 0.0, "rollout_batch_size": 4,
        "global_batch_size": 8, "micro_batch_size": 2, "eps_clip_high": 0.28, "use_kl_loss": True,
        "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl", "update_weight_buffer_size": 64 * 1024, **overrides})


def make_batch(n: int, seed: int, vocab: int = 192) -> TrainBatch:
    """n samples in groups of 2 with varied prompt/response lengths, a few loss-masked tokens, 0/1 rewards."""
    rng = random.Random(seed)
    tokens, lengths, masks, raw = [], [], [], []
    for i in range(n):
        prompt, response = rng.randint(2, 6), rng.randint(1, 6)
        tokens.append([rng.randrange(3, vocab) for _ in range(prompt + response)])
        lengths.append(response)
        mask = [1] * response
        if response > 2 and i % 3 == 0:
            mask[1] = 0  # a "tool" token: no loss
        masks.append(mask)
        raw.append(float(i % 2 == 0) if i % 4 < 2 else float(i % 2 == 1))
    groups = [i // 2 for i in range(n)]
    return TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=masks,
                      rewards=group_normalize_rewards(raw, groups, True), raw_rewards=raw,
                      truncated=[False] * n, group_indices=groups)


def engine_log_probs(engine, tokens, response_lengths) -> list[list[float]]:
    import httpx

    out = []
    for toks, r in zip(tokens, response_lengths):
        body = {"input_ids": toks, "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": 1},
                "return_logprob": True, "logprob_start_len": 0}
        meta = httpx.post(engine.get_url() + "/generate", json=body, timeout=60).json()["meta_info"]
        out.append([e[0] for e in meta["input_token_logprobs"][len(toks) - r:]])
    return out


def main() -> None:
    p = worker_parser()
    p.add_argument("--full", action="store_true")
    p.add_argument("--backend", default="gloo", help="nccl to run the same steps on GPUs")
    p.add_argument("--no-engine", action="store_true", help="skip the hf engine weight-push check")
    p.add_argument("--dynamic", action="store_true", help="--use-dynamic-batch-size micro-batches (24 tokens)")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    dynamic = {}
    if cli.dynamic:
        dynamic = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=24, log_probs_max_tokens_per_gpu=24)

    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    result: dict = {}
    engine = None
    try:
        if cli.full and cli.rank == 0 and not cli.no_engine:
            from slime.backends.hf_engine.engine import HFEngine

            engine = HFEngine(validated_args(hf_checkpoint=cli.model, rollout_seed=0, sglang_server_concurrency=8), 0)
            engine.init()
            result["engine_server_pid"] = engine.process.pid  # the test checks it is gone afterwards
        args = make_args(cli.model, cli.out, cli.backend, **dynamic)
        batch = make_batch(8, seed=0)
        actor = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
        result["start"] = actor.init(args, "actor", with_ref=True)
        lp_before = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        # Rollout log-probs off by a known 0.05 so train_rollout_logprob_abs_diff has a closed form.
        batch.rollout_log_probs = [[x + 0.05 for x in row] for row in lp_before]
        passes = []  # the store_prefix of each forward-only log-prob pass: "ref_", "" (the old policy's)
        counted = actor.log_probs_of_rows
        actor.log_probs_of_rows = lambda *a, **k: passes.append(a[3]) or counted(*a, **k)
        result["metrics"] = actor.train(0, batch)
        result["log_prob_passes"] = list(passes)
        lp_after = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        result.update(batch=batch.__dict__, lp_before=lp_before, lp_after=lp_after)

        if not cli.full:
            # Variants with closed-form first-step metrics (ratio 1, or a known constant ratio).
            variant = make_batch(8, seed=0)
            variant.rewards = [r + 0.25 for r in variant.rewards]  # mean advantage 0.25, so pg_loss != 0
            vars(args).update(advantage_estimator="gspo", calculate_per_token_loss=True, entropy_coef=0.01)
            result["metrics_gspo_per_token"] = actor.train(1, variant)
            lp_now = actor.compute_log_probs(variant.tokens, variant.response_lengths)
            vars(args).update(advantage_estimator="grpo", calculate_per_token_loss=False, entropy_coef=0.0,
                              use_rollout_logprobs=True)
            variant.rollout_log_probs = [[x + 0.05 for x in row] for row in lp_now]
            result["metrics_rollout_logprobs"] = actor.train(2, variant)
            result["variant_batch"] = variant.__dict__
            vars(args).update(ref_update_interval=3)  # rollout 2 was the third: the reference takes the weights
            result["metrics_ref_update"] = actor.train(2, variant)
            ref_state = actor.ref_model.state_dict()
            result["ref_equals_actor"] = all(torch.equal(ref_state[k].full_tensor(), t.full_tensor())
                                             for k, t in actor.model.state_dict().items())
            # the token rewards take the KL of the old policy to the reference: its pass runs before training
            vars(args).update(use_rollout_logprobs=False, ref_update_interval=0, kl_coef=0.01)
            passes.clear()
            actor.train(3, variant)
            result["log_prob_passes_kl_coef"] = list(passes)

        if cli.full:
            if engine is not None:
                result["engine_lp_before_push"] = engine_log_probs(engine, batch.tokens, batch.response_lengths)
            actor.update_weights([engine] if engine is not None else [], weight_version=1)
            if engine is not None:
                result["engine_lp_after_push"] = engine_log_probs(engine, batch.tokens, batch.response_lengths)
                result["engine_weight_version"] = engine.get_weight_version()

            actor.save(0)
            if cli.rank == 0:
                from transformers import AutoModelForCausalLM

                from slime.backends.fsdp_utils.data import forward_response_log_probs
                from slime.backends.training.batching import make_micro_batch, unpad_per_token

                plain = AutoModelForCausalLM.from_pretrained(os.path.join(args.save, "iter_0000000")).eval()
                mb = make_micro_batch(batch.tokens, batch.response_lengths)
                with torch.no_grad():
                    lp, _ = forward_response_log_probs(plain, mb, TEMPERATURE)
                result["lp_from_pretrained"] = unpad_per_token(lp, batch.response_lengths)

            resumed = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
            resumed_args = make_args(cli.model, cli.out, cli.backend, load=args.save, **dynamic)
            result["start_resumed"] = resumed.init(resumed_args, "actor", True)
            result["lp_resumed"] = resumed.compute_log_probs(batch.tokens, batch.response_lengths)
            fresh_optim = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
            fresh_args = make_args(cli.model, cli.out, cli.backend, load=args.save, no_load_optim=True,
                                    **dynamic)
            fresh_optim.init(fresh_args, "actor", True)
            finetuned = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
            result["start_finetune"] = finetuned.init(
                make_args(cli.model, cli.out, cli.backend, load=args.save, finetune=True, **dynamic), "actor", True)
            result["global_step_finetune"] = finetuned.global_step
            result["lp_finetune"] = finetuned.compute_log_probs(batch.tokens, batch.response_lengths)

            batch2 = make_batch(16, seed=1)  # two optimizer steps of 8
            for name, a in (("continued", actor), ("resumed", resumed), ("fresh_optim", fresh_optim)):
                result[f"metrics2_{name}"] = a.train(1, batch2)
                result[f"lp2_{name}"] = a.compute_log_probs(batch2.tokens, batch2.response_lengths)
    finally:
        if engine is not None:
            engine.shutdown()
    write_result(cli, result)
    actor.shutdown()


if __name__ == "__main__":
    main()
