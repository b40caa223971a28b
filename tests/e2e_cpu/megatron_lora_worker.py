"""One training rank of the Megatron trainer with LoRA, for tests/e2e_cpu/test_megatron_lora.py (a process per rank,
the CPU shim without CUDA). Drives `MegatronTrainRayActor` over a real gloo group; rank 0 writes <out>/result.json:
  init (the adapter from --lora-adapter-path, or from --load's checkpoint) -> log-probs -> one train step (which
  parameters changed, on every rank) -> log-probs -> save (torch_dist, the PEFT adapter folder, --save-hf merged) ->
  a second train step (the loss a resume must reproduce);
  --load DIR: init from the checkpoint instead and only report the start rollout and that second step;
  --engine: rank 0 also starts an `hf` engine server; after the second step the adapter is pushed to it and the
  engine's log-probs reported beside the trainer's.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()

import torch.distributed as dist  # noqa: E402

from tests.args import make_args as validated_args  # noqa: E402
from tests.conftest import model_args  # noqa: E402
from tests.e2e_cpu.fsdp_worker import engine_log_probs, make_batch  # noqa: E402
from tests.e2e_cpu.ranks import worker_parser, write_prompt_file, write_result  # noqa: E402


def make_args(cli):
    from slime.config.arguments import parse_args

    argv = [
        *model_args("tiny-qwen3"), "--train-backend", "megatron", "--transformer-impl", "local",
        "--hf-checkpoint", cli.model, "--prompt-data", write_prompt_file(cli),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--num-rollout", "3", "--actor-num-gpus-per-node", str(cli.world_size),
        "--tensor-model-parallel-size", str(cli.tp), "--pipeline-model-parallel-size", str(cli.pp), "--lr", "1e-2", "--clip-grad", "1.0", "--use-kl-loss",
        "--kl-loss-coef", "0.01", "--seed", "1234", "--rollout-num-gpus", "1",
        *(["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear"] if not cli.no_lora else []),
        "--save", os.path.join(cli.out, "ckpt"), "--save-hf", os.path.join(cli.out, "hf", "iter_{rollout_id}"),
    ]  # fmt: skip
    if cli.adapter:
        argv += ["--lora-adapter-path", cli.adapter]
    if cli.load:
        argv += ["--load", cli.load]
    return parse_args(argv + cli.extra.split())


def main() -> None:
    p = worker_parser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--no-lora", action="store_true", help="without --lora-rank (a LoRA checkpoint must be refused)")
    p.add_argument("--extra", default="", help="more slime flags, space-separated")
    p.add_argument("--adapter", help="--lora-adapter-path")
    p.add_argument("--load")
    p.add_argument("--engine", action="store_true")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)

    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.utils.lora_adapter import is_adapter_name

    args = make_args(cli)
    batch = make_batch(8, seed=0)
    batch.rollout_log_probs = [[-1.0] * n for n in batch.response_lengths]
    result: dict = {"batch": batch.__dict__}
    engine = None
    actor = MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    try:
        result["start"] = actor.init(args, "actor", with_ref=True)
        if not cli.load:
            result["lp_before"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
            with actor.adapters_off():  # the KL term's reference pass
                result["lp_base"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
            result["lp_adapters_back"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
            before = {n: t.detach().clone() for n, t in actor.weight_tensors().items()}
            result["metrics"] = actor.train(0, batch)
            after = actor.weight_tensors()
            changed = sorted(f"rank{cli.rank}:{n}" for n, t in after.items() if not torch.equal(t, before[n]))
            adapters = sorted(f"rank{cli.rank}:{n}" for n in after if is_adapter_name(n))
            everyone: list = [None] * cli.world_size
            dist.all_gather_object(everyone, (changed, adapters))
            result["changed"] = sorted({n for c, _ in everyone for n in c})
            result["adapter_names"] = sorted({n for _, a in everyone for n in a})
            result["lp_after"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
            actor.save(0)
        result["next_metrics"] = actor.train(1, batch)
        if cli.engine:
            if cli.rank == 0:
                from slime.backends.hf_engine.engine import HFEngine

                engine = HFEngine(validated_args(hf_checkpoint=cli.model, rollout_seed=0,
                                                 sglang_server_concurrency=8), 0)
                engine.init()
            actor.update_weights([engine] if engine is not None else [], weight_version=2)
            result["lp_trainer"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
            if engine is not None:
                result["lp_engine"] = engine_log_probs(engine, batch.tokens, batch.response_lengths)
                result["engine_adapter"] = engine.get_server_info()["lora_adapter"]
    finally:
        write_result(cli, result)
        try:
            actor.shutdown()
        finally:
            if engine is not None:
                engine.shutdown()


if __name__ == "__main__":
    main()
