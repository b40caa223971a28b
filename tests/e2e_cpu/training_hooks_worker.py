"""One training rank for tests/e2e_cpu/test_training_hooks.py (a plain process per rank, no Ray).

It drives either backend's actor over a real gloo process group (megatron through the test-only CPU shim) the
way train.py does, without engines: init -> push -> (train -> push) per rollout, every rollout on the same batch
whose rollout log-probs are the initial policy's. Rank 0 writes <out>/result.json: the initial log-probs, then
per rollout the train metrics and the log-probs after it. --skewed lengthens two samples' prompts.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from tests.e2e_cpu.ranks import worker_parser, write_prompt_file, write_result  # noqa: E402


def make_args(cli) -> argparse.Namespace:
    from slime.config.arguments import parse_args
    from tests.conftest import model_args

    data = write_prompt_file(cli)
    argv = [
        "--train-backend", cli.backend, "--hf-checkpoint", cli.model, "--prompt-data", data,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--num-rollout", str(cli.rollouts), "--actor-num-gpus-per-node", str(cli.world_size),
        "--lr", "1e-2", "--clip-grad", "1.0", "--seed", "1234", "--debug-train-only", "--distributed-backend", "gloo",
        "--distributed-timeout-minutes", "5",
    ]  # fmt: skip
    if cli.backend == "megatron":
        argv = model_args("tiny-qwen3") + argv
    if cli.kl:
        argv += ["--use-kl-loss", "--kl-loss-coef", "0.01"]
    return parse_args(argv + cli.extra.split())


def main() -> None:
    p = worker_parser()
    p.add_argument("--backend", choices=["fsdp", "megatron"], required=True)
    p.add_argument("--rollouts", type=int, default=1)
    p.add_argument("--kl", action="store_true", help="a KL loss against the reference model")
    p.add_argument("--skewed", action="store_true", help="two long samples first, then six short ones")
    p.add_argument("--extra", default="", help="more slime flags, space-separated")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    if cli.backend == "megatron" and not torch.cuda.is_available():
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
    from tests.e2e_cpu.fsdp_worker import make_batch

    if cli.backend == "megatron":
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor as Actor
    else:
        from slime.backends.fsdp_utils.actor import FSDPTrainRayActor as Actor

    args = make_args(cli)
    actor = Actor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    result: dict = {"metrics": [], "lp_after": []}
    try:
        actor.init(args, "actor", with_ref=cli.kl)
        batch = make_batch(8, seed=0)
        if cli.skewed:
            for r, extra in ((0, 30), (1, 24)):  # longer prompts: the contiguous halves hold 4x the tokens
                batch.tokens[r] = [(t * 7 + 3) % 189 + 3 for t in range(extra)] + batch.tokens[r]
        result["lp_initial"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        batch.rollout_log_probs = result["lp_initial"]
        version = 1
        actor.update_weights([], version)
        for rollout_id in range(cli.rollouts):
            result["metrics"].append(actor.train(rollout_id, batch))
            result["lp_after"].append(actor.compute_log_probs(batch.tokens, batch.response_lengths))
            version += 1
            actor.update_weights([], version)
    finally:
        write_result(cli, result)
        actor.shutdown()


if __name__ == "__main__":
    main()
