"""One training rank for tests/e2e_cpu/test_trainer_params.py: a real trainer (fsdp, or megatron through the CPU
shim) built from slime flags, and what its parameters do. Rank 0 writes <out>/result.json.

--mode step: init, one optimizer step; per parameter whether it requires a gradient and the largest change the
  step made, the number of tensors the optimizer holds, the names the weight export (what a push sends) carries.
--mode save2: init, save rollout 0, one step, save rollout 1 (two iterations with different weights),
  torch.save the policy's parameters at each save to <out>/policy_<rollout>.pt, and report the trainer's
  log-probs of a probe batch at each save.
--mode ref: init only; torch.save the reference model's parameters to <out>/ref.pt and the policy's to
  <out>/policy.pt; the rollout id init returns is the result's "start".
When init refuses the flags (ValueError, FileNotFoundError) the result holds the error instead.
"""

from __future__ import annotations

import os
import sys
import types

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from tests.e2e_cpu.ranks import worker_parser, write_result  # noqa: E402


def _megatron_actor(cli, flags: list[str]):
    from tests.e2e_cpu import megatron_worker  # installs the CPU shim
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    mcli = types.SimpleNamespace(arch="qwen3", world_size=cli.world_size, rank=cli.rank, tp=1, pp=1, bf16=False,
                                 engine=False, broadcast=False, dynamic=False, load=None, extra=" ".join(flags),
                                 out=cli.out, model=cli.model)
    return megatron_worker.make_args(mcli), MegatronTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)


def _fsdp_actor(cli, flags: list[str]):
    from tests.e2e_cpu.fsdp_worker import make_args
    from slime.backends.fsdp_utils.actor import FSDPTrainRayActor

    args = make_args(cli.model, cli.out, argv=tuple(flags))
    return args, FSDPTrainRayActor(cli.world_size, cli.rank, "127.0.0.1", cli.port)


def _named_parameters(model, backend: str) -> dict[str, torch.nn.Parameter]:
    if backend == "megatron":
        from slime.backends.megatron_utils.model import unwrap

        return {n: p for chunk in model for n, p in unwrap(chunk).named_parameters()}
    return dict(model.named_parameters())


def _value(p: torch.Tensor) -> torch.Tensor:
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone().float().cpu()


def _values(model, backend: str) -> dict[str, torch.Tensor]:
    return {n: _value(p) for n, p in _named_parameters(model, backend).items()}


def _train_one_step(actor, rollout_id: int) -> None:
    from tests.e2e_cpu.fsdp_worker import make_batch

    batch = make_batch(8, seed=rollout_id)
    batch.rollout_log_probs = actor.compute_log_probs(batch.tokens, batch.response_lengths)
    actor.train(rollout_id, batch)


def main() -> None:
    p = worker_parser()
    p.add_argument("--backend", choices=["fsdp", "megatron"], required=True)
    p.add_argument("--mode", choices=["step", "save2", "ref"], required=True)
    p.add_argument("--flags", default="", help="more slime flags, space-separated")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)

    from tests.e2e_cpu.fsdp_worker import make_batch

    args, actor = (_megatron_actor if cli.backend == "megatron" else _fsdp_actor)(cli, cli.flags.split())
    result: dict = {}
    try:
        try:
            result["start"] = actor.init(args, "actor", with_ref=True)
        except (ValueError, FileNotFoundError) as e:
            result["error"] = str(e)
            return
        if cli.mode == "ref":
            torch.save(_values(actor.ref_model, cli.backend), os.path.join(cli.out, "ref.pt"))
            torch.save(_values(actor.model, cli.backend), os.path.join(cli.out, "policy.pt"))
        elif cli.mode == "save2":
            for rollout_id in (0, 1):
                if rollout_id:
                    _train_one_step(actor, rollout_id)
                actor.save(rollout_id)
                torch.save(_values(actor.model, cli.backend), os.path.join(cli.out, f"policy_{rollout_id}.pt"))
                probe = make_batch(6, seed=100)
                result["probe"] = {"tokens": probe.tokens, "response_lengths": probe.response_lengths}
                result[f"lp_{rollout_id}"] = actor.compute_log_probs(probe.tokens, probe.response_lengths)
        else:
            params = _named_parameters(actor.model, cli.backend)
            before = {n: _value(p) for n, p in params.items()}
            _train_one_step(actor, 0)
            result["params"] = {n: {"requires_grad": p.requires_grad,
                                    "change": float((_value(p) - before[n]).abs().max())}
                                for n, p in params.items()}
            result["optimizer_tensors"] = sum(len(g["params"]) for g in actor.optimizer.param_groups)
            if cli.backend == "megatron":
                from slime.backends.megatron_utils import weights

                result["pushed"] = sorted(n for n, _ in weights.iter_hf_weights(actor.model, args, actor.hf_config))
            else:
                result["pushed"] = sorted(actor.weight_tensors())
    finally:
        write_result(cli, result)
        actor.shutdown()


if __name__ == "__main__":
    main()
