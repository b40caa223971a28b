"""One fsdp training rank for tests/e2e_cpu/test_split_rollouts.py (a plain process per rank, no Ray).

It trains one rollout whose first rollout was split into two samples (9 rows, 8 rollouts = one step of
--global-batch-size 8, --micro-batch-size 2): over 2 ranks the step's rows split 5 + 4, i.e. 3 and 2 micro-batches
before the ranks agree on 3. Rank 0 writes <out>/result.json: the train metrics and the log-probs after it.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from tests.e2e_cpu.ranks import worker_parser, write_prompt_file, write_result  # noqa: E402

ROLLOUT_IDS = [0, 0, 1, 2, 3, 4, 5, 6, 7]


def main() -> None:
    cli = worker_parser().parse_args()
    os.makedirs(cli.out, exist_ok=True)
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor
    from slime.config.arguments import parse_args
    from tests.e2e_cpu.fsdp_worker import make_batch

    data = write_prompt_file(cli)
    args = parse_args([
        "--train-backend", "fsdp", "--hf-checkpoint", cli.model, "--prompt-data", data,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", str(cli.world_size),
        "--lr", "1e-2", "--clip-grad", "1.0", "--seed", "1234", "--debug-train-only", "--distributed-backend", "gloo",
        "--distributed-timeout-minutes", "5", "--weight-decay", "0",
    ])  # fmt: skip
    actor = FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    result: dict = {}
    try:
        actor.init(args, "actor", with_ref=False)
        batch = make_batch(len(ROLLOUT_IDS), seed=0)
        batch.rollout_ids = list(ROLLOUT_IDS)
        result["metrics"] = actor.train(0, batch)
        result["lp_after"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
    finally:
        write_result(cli, result)
        actor.shutdown()


if __name__ == "__main__":
    main()
