"""One training rank for tests/e2e_cpu/test_megatron_actor.py and tests/gpu/ (a plain process per rank).

Without CUDA it installs the test-only CPU shim (tests/megatron_cpu_shim.py); on GPUs it runs megatron-core
for real (nccl, optionally --bf16). It drives `MegatronTrainRayActor` directly
(no Ray) over a real gloo process group with the parallel layout given on the command line, and rank 0
writes what it saw to <out>/result.json:
  init from the HF checkpoint -> log-probs -> the whole model exported as HF tensors (compared with the
  checkpoint file) -> one train step -> log-probs -> save;
  --load DIR: init from a torch_dist checkpoint instead, and only report the start rollout and log-probs;
  --engine: rank 0 also starts an `hf` engine server, the trained weights are pushed to it and the
  engine's log-probs reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()

from tests.conftest import model_args  # noqa: E402
from tests.e2e_cpu.fsdp_worker import engine_log_probs, make_batch  # noqa: E402
from tests.e2e_cpu.ranks import worker_parser, write_prompt_file  # noqa: E402
from tests.args import make_args as validated_args  # noqa: E402

def make_args(cli) -> argparse.Namespace:
    from slime.config.arguments import parse_args

    data = write_prompt_file(cli)
    argv = [
        *model_args(f"tiny-{cli.arch.replace('_', '-')}"), "--train-backend", "megatron", "--hf-checkpoint", cli.model,
        "--prompt-data", data, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--num-rollout", "2",
        "--actor-num-gpus-per-node", str(cli.world_size),
        "--tensor-model-parallel-size", str(cli.tp), "--pipeline-model-parallel-size", str(cli.pp),
        "--lr", "1e-3", "--clip-grad", "1.0", "--use-kl-loss", "--kl-loss-coef", "0.01", "--seed", "1234",
        "--save", os.path.join(cli.out, "ckpt"), "--update-weight-buffer-size", str(64 * 1024),
    ]  # fmt: skip
    if cli.bf16:
        argv.append("--bf16")
    # With an engine it shares the GPU (the push hands over CUDA IPC handles there), or with --broadcast
    # it stands apart and the push goes over a process group formed with it.
    argv += ["--colocate"] if cli.engine and not cli.broadcast else ["--rollout-num-gpus", "1"]
    if cli.dynamic:
        argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"]
    if cli.load:
        argv += ["--load", cli.load]
    argv += cli.extra.split()
    return parse_args(argv)


def main() -> None:
    p = worker_parser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--arch", default="qwen3", help="the tiny-<arch> MODEL_ARGS matching --model")
    p.add_argument("--extra", default="", help="more slime flags, space-separated")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--load")
    p.add_argument("--engine", action="store_true")
    p.add_argument("--broadcast", action="store_true", help="with --engine: push by broadcast, not colocated")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)

    from slime.backends.megatron_utils import weights
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    result: dict = {}
    engine = None
    args = make_args(cli)
    batch = make_batch(8, seed=0)
    actor = MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)
    try:
        result["start"] = actor.init(args, "actor", with_ref=True)
        result["lp_before"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        if cli.load:
            return
        from safetensors.torch import load_file

        hf = load_file(os.path.join(cli.model, "model.safetensors"))
        exported = dict(weights.iter_hf_weights(actor.model, args, actor.hf_config))
        result["export_names_missing"] = sorted(set(hf) - set(exported))
        result["export_names_extra"] = sorted(set(exported) - set(hf))
        result["export_max_abs_diff"] = max(
            float((exported[k].float().cpu() - hf[k].float()).abs().max()) for k in hf if k in exported)

        batch.rollout_log_probs = [[x + 0.05 for x in row] for row in result["lp_before"]]
        result["metrics"] = actor.train(0, batch)
        result["lp_after"] = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        actor.save(0)

        if cli.engine and cli.rank == 0:
            from slime.backends.hf_engine.engine import HFEngine

            if cli.broadcast and torch.cuda.is_available():
                # NCCL refuses two ranks of one group on one GPU: the stand-apart engine takes the last GPU
                # (on one GPU it shares it, and the broadcast test is for CPU/gloo or several GPUs).
                os.environ["CUDA_VISIBLE_DEVICES"] = str(max(cli.world_size, torch.cuda.device_count()) - 1)
            engine = HFEngine(validated_args(hf_checkpoint=cli.model, rollout_seed=0,
                                                 sglang_server_concurrency=8), 0)
            engine.init()
            result["engine_server_pid"] = engine.process.pid
        actor.update_weights([engine] if engine is not None else [], weight_version=1)
        if engine is not None:
            result["engine_lp_after_push"] = engine_log_probs(engine, batch.tokens, batch.response_lengths)
            result["engine_weight_version"] = engine.get_weight_version()
    finally:
        if cli.rank == 0:
            result["batch"] = batch.__dict__
            with open(os.path.join(cli.out, "result.json"), "w") as f:
                json.dump(result, f)
        try:
            actor.shutdown()  # first: it dissolves the weight broadcast group with the engine
        finally:
            if engine is not None:
                engine.shutdown()


if __name__ == "__main__":
    main()
