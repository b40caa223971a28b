"""What ran to produce a tensor: the names of the autograd nodes behind it, for tests that check which kernel or
copy a computation took (e.g. cuDNN's attention backward, no index copies)."""

from __future__ import annotations

import torch


def node_names(t: torch.Tensor) -> set[str]:
    """The class names of every autograd node reachable from `t.grad_fn`."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(nxt for nxt, _ in fn.next_functions)
    return {type(fn).__name__ for fn in seen}
