"""Which parameters train: --only-train-params-name-list / --freeze-params-name-list, for both backends.

A pattern is a Python regular expression searched (`re.search`, so a plain substring works) in a parameter's
name as the backend's model names it (megatron-core: `decoder.layers.0.mlp.linear_fc1.weight`; transformers:
`model.layers.0.mlp.up_proj.weight`). With --only-train-params-name-list, a parameter trains when any pattern
is found in its name; with --freeze-params-name-list, it trains unless one is. A parameter that does not train
gets `requires_grad=False` before the model is wrapped for training, so it has no gradient buffer and the
optimizer never holds it; it is still part of the model's state, so weight pushes and checkpoints carry it.

A pattern that matches no parameter is an error (a typo would otherwise train everything, or nothing). Pipeline
stages each hold a part of the model, so the check counts matches over all training ranks when
torch.distributed is initialised.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable

import torch
import torch.distributed as dist


def selected_flag(args: argparse.Namespace) -> tuple[str, list[str]] | None:
    """The freezing flag given (validation refuses both together) and its patterns, or None."""
    if args.only_train_params_name_list:
        return "--only-train-params-name-list", args.only_train_params_name_list
    if args.freeze_params_name_list:
        return "--freeze-params-name-list", args.freeze_params_name_list
    return None


def trains(name: str, patterns: list[str], only_train: bool) -> bool:
    """Whether the parameter `name` trains under the flag's patterns."""
    found = any(re.search(p, name) for p in patterns)
    return found if only_train else not found


def apply_freeze(args: argparse.Namespace, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 collective: bool = True) -> list[str]:
    """Set `requires_grad=False` on the parameters the flags leave untrained; returns their names.

    `collective`: sum the per-pattern match counts over all ranks (every rank must call it) before refusing
    a pattern that matches nothing."""
    chosen = selected_flag(args)
    if chosen is None:
        return []
    flag, patterns = chosen
    only_train = flag == "--only-train-params-name-list"
    params = list(named_parameters)
    hits = torch.tensor([sum(1 for n, _ in params if re.search(p, n)) for p in patterns], dtype=torch.long)
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        hits = hits.to("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else hits
        dist.all_reduce(hits)
        hits = hits.cpu()
    unmatched = [p for p, n in zip(patterns, hits.tolist()) if n == 0]
    if unmatched:
        names = [n for n, _ in params]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise ValueError(f"{flag}: the pattern(s) {unmatched} match no parameter name (re.search); the model's "
                         f"parameters are: {shown}. Fix the pattern(s).")
    frozen = []
    for name, param in params:
        if not trains(name, patterns, only_train):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen
