"""One training rank for tests/e2e_cpu/test_freeze_params.py: --only-train-params-name-list /
--freeze-params-name-list on a real trainer (fsdp, or megatron through the CPU shim), one optimizer step.

Rank 0 writes <out>/result.json: per parameter, whether it requires a gradient and the largest change the step
made; the number of tensors the optimizer holds; the names the weight export (what a push sends) carries; or,
when init refuses the flags, the error.
"""

from __future__ import annotations

import json
import os
import sys
import types

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from tests.e2e_cpu.ranks import worker_parser  # noqa: E402


def _megatron_actor(cli, flags: list[str]):
    from tests.e2e_cpu import megatron_worker  # installs the CPU shim
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    mcli = types.SimpleNamespace(arch="qwen3", world_size=cli.world_size, tp=1, pp=1, bf16=False, engine=False,
                                 broadcast=False, dynamic=False, load=None, extra=" ".join(flags), out=cli.out,
                                 model=cli.model)
    return megatron_worker.make_args(mcli), MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)


def _fsdp_actor(cli, flags: list[str]):
    from tests.e2e_cpu.fsdp_worker import make_args
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    only = flags[1:] if flags and flags[0] == "--only-train-params-name-list" else None
    frozen = flags[1:] if flags and flags[0] == "--freeze-params-name-list" else None
    args = make_args(cli.model, cli.out, only_train_params_name_list=only, freeze_params_name_list=frozen)
    return args, FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)


def _named_parameters(actor, backend: str) -> dict[str, torch.nn.Parameter]:
    if backend == "megatron":
        from slime.backends.megatron_utils.model import unwrap

        return {n: p for chunk in actor.model for n, p in unwrap(chunk).named_parameters()}
    return dict(actor.model.named_parameters())


def _value(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone().float().cpu()


def main() -> None:
    p = worker_parser()
    p.add_argument("--backend", choices=["fsdp", "megatron"], required=True)
    p.add_argument("--flags", default="", help="the freezing flag and its patterns, space-separated")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    from tests.e2e_cpu.fsdp_worker import make_batch

    flags = cli.flags.split()
    args, actor = (_megatron_actor if cli.backend == "megatron" else _fsdp_actor)(cli, flags)
    result: dict = {}
    try:
        try:
            actor.init(args, "actor", with_ref=True)
        except ValueError as e:
            result["error"] = str(e)
            return
        params = _named_parameters(actor, cli.backend)
        before = {n: _value(p) for n, p in params.items()}
        batch = make_batch(8, seed=0)
        batch.rollout_log_probs = actor.compute_log_probs(batch.tokens, batch.response_lengths)
        actor.train(0, batch)
        result["params"] = {n: {"requires_grad": p.requires_grad,
                                "change": float((_value(p) - before[n]).abs().max())} for n, p in params.items()}
        groups = actor.optimizer.param_groups
        result["optimizer_tensors"] = sum(len(g["params"]) for g in groups)
        if cli.backend == "megatron":
            from slime.backends.megatron_utils import weights

            result["pushed"] = sorted(n for n, _ in weights.iter_hf_weights(actor.model, args, actor.hf_config))
        else:
            result["pushed"] = sorted(actor.weight_tensors())
    finally:
        if cli.rank == 0:
            with open(os.path.join(cli.out, "result.json"), "w") as f:
                json.dump(result, f)
        actor.shutdown()


if __name__ == "__main__":
    main()
