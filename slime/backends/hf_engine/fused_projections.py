"""Joined projections in the hf engine on CUDA: one matrix product for an attention's query, key and value, one for
an MLP's gate and up projection.

transformers' attention (Qwen, Llama, GLM and the models copied from them) multiplies the hidden states by
`q_proj`, `k_proj` and `v_proj` one after the other, and its gated MLP by `gate_proj` and `up_proj`: five matrix
products a layer where two read the same inputs. In a decode step of a small model, bound by its kernel count and
not by bandwidth (benchmarks/README.md, `decode_speed.py --profile`), each is a small GEMM of its own; joined, a
layer runs two (plus `o_proj` and `down_proj`) and reads each weight in one pass.

`join_projections(model)` moves each group's weights (and biases) into one storage, each Linear's weight a block of
rows of it (`param.data` is pointed at its block: the Parameter objects, their names and shapes stay, so weight
pushes, the weight checker and the release/resume of release.py, which keeps views of one storage views of one
storage, see nothing new), and gives the modules forwards that multiply by the joined block:
- the MLP's forward computes `down_proj(act_fn(gate) * up)` from one product split in two (transformers' own
  operations after it, so the same roundings);
- `q_proj`'s forward multiplies by the joined q/k/v block and keeps the key's and value's parts, which `k_proj` and
  `v_proj` return when called with the same input tensor (as the attention calls them); any other input goes
  through their own product.
Each group is checked first on a random input on the model's device: the joined forward must give what the
modules' own forwards give (else the group keeps its own). Where the blocks no longer lie end to end in one storage
(a weight replaced by something else than a copy into it), the modules' own forwards run. On CPU the engine does not
join (CPU runs stay bit-identical to transformers').
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("slime.hf_engine")

MLP = ("gate_proj", "up_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj")


def _linears(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """`module`'s plain Linears of these names, when they can be joined (same input size, dtype and device; biases on
    all or none), else None."""
    linears = [getattr(module, n, None) for n in names]
    if not all(type(m) is torch.nn.Linear for m in linears):  # noqa: E721 - a subclass (LoRA, quantised) may differ
        return None
    first = linears[0].weight
    if any(m.weight.shape[1] != first.shape[1] or m.weight.dtype != first.dtype or m.weight.device != first.device
           for m in linears):
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None
    return linears


def _move_into_one_storage(tensors: list[torch.Tensor]) -> None:
    """Point each tensor (a Parameter) at its block of rows of one new storage holding them end to end."""
    joined = torch.cat([t.detach().reshape(t.shape[0], -1) for t in tensors])
    for t, block in zip(tensors, joined.split([t.shape[0] for t in tensors])):
        t.data = block.view(t.shape)


def joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one (concatenated along their first dimension, no copy) when they lie end to end, contiguous,
    in one storage; else None."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)


def _product(linears: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor | None:
    """x times the joined weights (plus the joined biases), or None where they are not joined or x differs in dtype."""
    weight = joined([m.weight for m in linears])
    if weight is None or x.dtype != weight.dtype or x.device != weight.device:
        return None
    bias = None
    if linears[0].bias is not None:
        bias = joined([m.bias for m in linears])
        if bias is None:
            return None
    return F.linear(x, weight, bias)


class _JoinedMLP:
    """A gated MLP's forward with its gate and up projections as one product."""

    def __init__(self, mlp: torch.nn.Module):
        self.mlp, self.own = mlp, mlp.forward
        self.linears = [getattr(mlp, n) for n in MLP]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _product(self.linears, x)
        if out is None:
            return self.own(x)
        gate, up = out.split(self.linears[0].out_features, dim=-1)
        return self.mlp.down_proj(self.mlp.act_fn(gate) * up)


class _JoinedQKV:
    """q_proj's forward computes the key's and value's products too; k_proj's and v_proj's hand them out for the
    same input (and compute their own for any other)."""

    def __init__(self, attention: torch.nn.Module):
        self.linears = [getattr(attention, n) for n in ATTENTION]
        self.own = [m.forward for m in self.linears]
        self.sizes = [m.out_features for m in self.linears]
        self.pending: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None  # (the input, part index -> output)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        out = _product(self.linears, x)
        if out is None:
            self.pending = None
            return self.own[0](x)
        q, k, v = out.split(self.sizes, dim=-1)
        self.pending = (x, {1: k, 2: v})
        return q

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.pending is not None and self.pending[0] is x and index in self.pending[1]:
            out = self.pending[1].pop(index)
            if not self.pending[1]:
                self.pending = None  # nothing kept past the attention's three calls
            return out
        return self.own[index](x)

    def install(self) -> None:
        q, k, v = self.linears
        q.forward = lambda x: self.query(x)
        k.forward = lambda x: self.part(1, x)
        v.forward = lambda x: self.part(2, x)
        for m in self.linears:
            m.forward.joined = self

    def remove(self) -> None:
        self.pending = None
        for m in self.linears:
            del m.forward


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to rounding: a different product order changes the last bits, a wrong block changes everything."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    return bool((got.float() - want.float()).norm() <= 4 * eps * want.float().norm() + 1e-30)


def _random_input(linear: torch.nn.Linear) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, linear.in_features, generator=gen)
    return x.to(linear.weight.device, linear.weight.dtype)


def _join_mlp(mlp: torch.nn.Module) -> bool:
    linears = _linears(mlp, MLP)
    if linears is None or not isinstance(getattr(mlp, "down_proj", None), torch.nn.Module) or \
            not callable(getattr(mlp, "act_fn", None)):
        return False
    x = _random_input(linears[0])
    with torch.no_grad():
        try:
            want = mlp(x)
        except (RuntimeError, TypeError, ValueError):
            return False
        _move_into_one_storage([m.weight for m in linears])
        if linears[0].bias is not None:
            _move_into_one_storage([m.bias for m in linears])
        forward = _JoinedMLP(mlp)
        if not _close(forward(x), want):
            return False  # the storage stays joined (the same values); the module's own forward serves
    mlp.forward = forward
    return True


def _join_qkv(attention: torch.nn.Module) -> bool:
    linears = _linears(attention, ATTENTION)
    if linears is None:
        return False
    x = _random_input(linears[0])
    with torch.no_grad():
        want = [m(x) for m in linears]
        _move_into_one_storage([m.weight for m in linears])
        if linears[0].bias is not None:
            _move_into_one_storage([m.bias for m in linears])
        forward = _JoinedQKV(attention)
        got = [forward.query(x), forward.part(1, x), forward.part(2, x)]
        if forward.pending is not None or not all(_close(g, w) for g, w in zip(got, want)):
            return False
    forward.install()
    return True


def _is_joined(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """The group is joined already (a second call: its forwards are ours)."""
    holder = module if names == MLP else getattr(module, names[0])
    forward = holder.__dict__.get("forward")
    return isinstance(forward, _JoinedMLP) or hasattr(forward, "joined")


def join_projections(model: torch.nn.Module) -> int:
    """Join the query/key/value and the gate/up projections of every module of `model` that has them and computes
    the same joined; returns how many groups were joined."""
    done = kept = 0
    for module in model.modules():
        for names, join in ((MLP, _join_mlp), (ATTENTION, _join_qkv)):
            if all(hasattr(module, n) for n in names):
                if _is_joined(module, names):
                    done += 1
                elif join(module):
                    done += 1
                else:
                    kept += 1
    logger.info("projections: %d group(s) joined (q/k/v, gate/up: one product each), %d kept as they are", done,
                kept)
    return done


def restore_projections(model: torch.nn.Module) -> None:
    """The modules' own forwards again (a benchmark compares both forms); the weights stay in their joined storages,
    which changes nothing for the own forwards."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _JoinedMLP):
            del module.forward
        elif hasattr(forward, "joined") and module is forward.joined.linears[0]:
            forward.joined.remove()
