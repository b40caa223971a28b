"""Leaving frozen parameters out of weight pushes.

A parameter of the policy that does not require a gradient (`--freeze-params-name-list` /
`--only-train-params-name-list`, e.g. a frozen vision tower) keeps its value for the whole run, so once an engine
holds it, sending it again moves bytes for nothing. The first push of a run sends every tensor (it brings the
engines in line with the trainer, which may have started from `--load`); later pushes leave the frozen ones out,
except when the engines would not keep them:

- the engines release their weights between steps (`--offload-rollout`, on with `--colocate`): a release frees
  every parameter and gives the memory back uninitialised (SGLang's memory saver, the hf engine's `free` mode), so
  every push restores all of them;
- the route writes whole checkpoints (`--update-weight-transport disk`: each version folder is a complete HF
  checkpoint that the engines load; `--update-weight-mode delta`'s full pushes);
- an engine does not report the weight version of the last completed push (a fault-tolerant restart: the new
  server loaded `--hf-checkpoint`, not the trainer's weights, and reports its initial version), or the last push
  failed part way.

Rank 0 holds the route and the engines, so it decides, and broadcasts the decision: every rank takes part in
gathering each tensor, so all of them must leave out the same ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from slime.weight_sync.push import engine_weight_versions


class FrozenPushes:
    """Per training rank: which tensors a push leaves out. `frozen`: the names (as the backend's push walks them)
    of the parameters that never change; `engines_release`: the engines free their weights between pushes."""

    def __init__(self, frozen: Iterable[str], engines_release: bool):
        self.frozen = frozenset(frozen)
        self.engines_release = engines_release
        self._version: str | None = None  # rank 0: the weight version of the last push that completed
        self._any_frozen: bool | None = None  # whether any training rank holds a frozen parameter (asked once)

    def left_out(self, route: Any, engines: Sequence[Any]) -> frozenset[str]:
        """Collective (every training rank, before the push gathers anything): the names this push leaves out.
        `route` (rank 0's, begun for `engines`; None elsewhere) says whether it needs every tensor."""
        if self.engines_release:
            return frozenset()
        if not self._anywhere():  # a run without frozen parameters: no engine calls, no broadcast per push
            return frozenset()
        # every rank joins the broadcast, also one that holds no frozen parameter (a pipeline stage without any)
        decision = [True]
        if route is not None:
            versions = engine_weight_versions(engines)
            decision = [sends_everything(self._version, versions, route.needs_every_tensor())]
            self._version = None  # until this push completes (`pushed`)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        return frozenset() if decision[0] else self.frozen

    def _anywhere(self) -> bool:
        """Collective on the first call: whether some rank has frozen parameters (a pipeline stage may have none
        while another has them, so every rank must take the same branch in `left_out`)."""
        if self._any_frozen is None:
            held = [bool(self.frozen)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                held = [None] * dist.get_world_size()
                dist.all_gather_object(held, bool(self.frozen))
            self._any_frozen = any(held)
        return self._any_frozen

    def pushed(self, weight_version: int | str) -> None:
        """The push of `weight_version` completed: the engines hold every frozen tensor."""
        self._version = str(weight_version)


def sends_everything(previous: str | None, versions: list[str], route_needs_every_tensor: bool) -> bool:
    """Whether a push must send the frozen tensors too: no push completed yet (`previous` None: the run's first,
    or the last one failed), an engine's weight version (`versions`) is not the last push's `previous` (a
    restarted server), or the route needs them."""
    return previous is None or any(v != previous for v in versions) or route_needs_every_tensor


def frozen_parameter_names(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Names of the parameters that do not require a gradient (buffers are not parameters: never frozen)."""
    return {n for n, p in named_parameters if isinstance(p, torch.nn.Parameter) and not p.requires_grad}
