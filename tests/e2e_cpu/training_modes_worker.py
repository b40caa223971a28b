"""One training rank for tests/e2e_cpu/test_sft.py and test_opd.py (a plain process per rank, no Ray).

It drives either backend's actor (megatron through the test-only CPU shim) over a real gloo process group the way
train.py does with --debug-train-only, and rank 0 writes <out>/result.json with every rollout's train metrics:
  --mode sft: each rollout from slime.rollout.sft_rollout.generate_rollout on the real data source (the prompt file
    of the command line), through samples_to_train_batch, as the RolloutManager does;
  --mode opd: the same fixed batch every rollout (tests/e2e_cpu/fsdp_worker.make_batch standing in for the
    student's samples: no engine), trained with the trainer-held teacher of --opd-teacher-load; the initial
    log-probs of the batch are written too;
  --mode opd-batch-teacher: the same, but the batch carries the teacher's log-probs (a transformers forward of
    --teacher on it: the raw log-softmax at each response token, what slime's plugins take from a teacher server)
    and no task reward (rewards 0, as slime.rollout.on_policy_distillation.post_process_rewards returns), for
    --opd-type sglang.
The slime flags come from --flags (space-separated), after the backend's own (MODEL_ARGS for megatron).
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from tests.e2e_cpu.ranks import worker_parser, write_result  # noqa: E402


def main() -> None:
    p = worker_parser()
    p.add_argument("--backend", choices=["fsdp", "megatron"], required=True)
    p.add_argument("--mode", choices=["sft", "opd", "opd-batch-teacher"], required=True)
    p.add_argument("--teacher", default=None, help="--mode opd-batch-teacher: the teacher's HF folder")
    p.add_argument("--flags", default="", help="slime flags, space-separated")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    from tests.e2e_cpu.fsdp_worker import make_batch
    from tests.e2e_cpu.test_megatron_actor import hf_log_probs

    batch = make_batch(8, seed=0)
    if cli.mode == "opd-batch-teacher":  # before the shim, which breaks a transformers forward in this process
        batch.teacher_log_probs = hf_log_probs(cli.teacher, batch.__dict__)
        batch.rewards = [0.0] * len(batch)
        batch.raw_rewards = [0.0] * len(batch)
    if cli.backend == "megatron" and not torch.cuda.is_available():
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
    from slime.config.arguments import parse_args
    from slime.rollout import sft_rollout
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.train_data import flatten_groups, samples_to_train_batch
    from tests.conftest import model_args

    if cli.backend == "megatron":
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor as Actor
    else:
        from slime.backends.fsdp_utils.actor import FSDPTrainRayActor as Actor

    argv = ["--train-backend", cli.backend, "--hf-checkpoint", cli.model, "--actor-num-gpus-per-node",
            str(cli.world_size), "--distributed-backend", "gloo", "--distributed-timeout-minutes", "5"]
    if cli.backend == "megatron":
        argv = model_args("tiny-qwen3") + argv
    args = parse_args(argv + cli.flags.split())
    data_source = RolloutDataSourceWithBuffer(args) if cli.mode == "sft" else None
    num_rollout = args.num_rollout or len(data_source) // args.rollout_batch_size * args.num_epoch
    actor = Actor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    result: dict = {"metrics": [], "num_rollout": num_rollout}
    try:
        actor.init(args, "actor", with_ref=False, num_rollout=num_rollout)
        if cli.mode != "sft":
            result["batch"] = batch.__dict__
            result["lp_initial"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        for rollout_id in range(num_rollout):
            if cli.mode == "sft":
                groups = sft_rollout.generate_rollout(args, rollout_id, data_source)
                batch = samples_to_train_batch(args, flatten_groups(groups, args.rollout_function_path))
            result["metrics"].append(actor.train(rollout_id, batch))
    finally:
        write_result(cli, result)
        actor.shutdown()


if __name__ == "__main__":
    main()
