"""Tensor-parallel shards of Megatron GPTModel parameters: full tensor -> TP shards, and back.

Layouts follow megatron-core: column-parallel weights (QKV, MLA up-projections, vocabulary) split along
rows; row-parallel weights (`linear_proj`, `linear_fc2`) along columns; norms, routers, expert biases and
the MLA down-projections (TE spec: "duplicated") are replicated. Two fused tensors need care:

- `linear_qkv` rows are grouped per query group ([q_g; k_g; v_g]), so a contiguous row split hands each
  rank whole groups: a plain chunk, valid when TP divides the number of query groups;
- `linear_fc1` of a gated MLP is [gate; up] in full, but each rank holds [gate_i; up_i]: sharding splits
  gate and up separately and regroups, gathering undoes it.

Experts use the expert-tensor-parallel size (`--expert-tensor-parallel-size`), shared experts and dense
MLPs the TP size; the caller passes the size that applies. LoRA adapters (`<linear>.lora_A.weight`, r × in, and
`<linear>.lora_B.weight`, out × r) split with their layer: on a column-parallel layer B like its weight (rows, fc1
regrouped) and A replicated; on a row-parallel one A like its weight (columns) and B replicated. Simplification: the MLA down-projections are
treated as replicated (TE spec); the local spec shards them, but local MLA does not build in 0.16.
"""

from __future__ import annotations

import re

import torch

Tensor = torch.Tensor


def shard_kind(name: str) -> str:
    """'vocab', 'column', 'row', 'fc1' (gated, regrouped) or 'replicated' for a Megatron parameter name."""
    n = re.sub(r"^(?:module\.)+", "", name)
    lora = re.search(r"\.lora_([AB])\.weight$", n)
    if lora:
        base = shard_kind(n[: lora.start()] + ".weight")
        if base == "row":
            return "row" if lora.group(1) == "A" else "replicated"
        if base in ("column", "fc1"):
            return base if lora.group(1) == "B" else "replicated"
        raise KeyError(f"no tensor-parallel layout known for the adapter {name!r} (on a {base} layer)")
    if n.startswith("visual."):
        return "replicated"  # a vision-language model's HF vision tower runs whole on every TP rank
    if n in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if "norm" in n or ".router." in n or "_extra_state" in n:
        return "replicated"
    if n.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        return "replicated"
    if re.search(r"linear_fc1\.weight\d*$", n):
        return "fc1"
    if re.search(r"(linear_proj|linear_fc2)\.weight\d*$", n):
        return "row"
    if re.search(r"(linear_proj|linear_fc2)\.bias$", n):
        return "replicated"  # row-parallel bias is added after the reduction
    if re.search(r"(linear_qkv|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|linear_fc1)\.(weight|bias)$", n):
        return "column"
    raise KeyError(f"no tensor-parallel layout known for {name!r}")


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (sharded with the expert-tensor-parallel size; shared experts are not)."""
    return ".experts." in name


def shard(name: str, full: Tensor, tp: int, gated: bool = True) -> list[Tensor]:
    """Split a full tensor into the `tp` shards ranks 0..tp-1 hold. `gated=False` for a non-GLU fc1."""
    kind = shard_kind(name)
    if tp == 1 or kind == "replicated":
        return [full.clone() for _ in range(tp)]
    if kind == "fc1" and gated:
        gate, up = torch.chunk(full, 2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]
    dim = 1 if kind == "row" else 0
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over TP {tp}")
    return [t.clone() for t in torch.chunk(full, tp, dim=dim)]


def gather(name: str, shards: list[Tensor], gated: bool = True) -> Tensor:
    """Inverse of `shard`: the full tensor from the shards of ranks 0..tp-1."""
    kind = shard_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "fc1" and gated:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=1 if kind == "row" else 0)


def shard_state_dict(sd: dict[str, Tensor], tp: int, etp: int | None = None, gated: bool = True) -> list[dict]:
    """Every parameter sharded: one state dict per TP rank (experts split over `etp`, default `tp`).

    With etp < tp an expert shard is repeated over the TP ranks that share it (rank r holds shard
    r % etp), which is how megatron-core lays out expert-tensor parallelism inside one TP group.
    """
    etp = tp if etp is None else etp
    out: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, t in sd.items():
        size = etp if is_expert_param(name) else tp
        parts = shard(name, t, size, gated)
        for r in range(tp):
            out[r][name] = parts[r % size]
    return out


def gather_state_dict(shards: list[dict[str, Tensor]], etp: int | None = None, gated: bool = True) -> dict:
    tp = len(shards)
    etp = tp if etp is None else etp
    return {
        name: gather(name, [s[name] for s in shards[: etp if is_expert_param(name) else tp]], gated)
        for name in shards[0]
    }


def expert_global_index(local_index: int, ep_rank: int, num_experts: int, ep: int) -> int:
    """Global expert id of a rank's local expert: experts are split into EP contiguous blocks."""
    if num_experts % ep:
        raise ValueError(f"--num-experts {num_experts} does not split over EP {ep}")
    return ep_rank * (num_experts // ep) + local_index
