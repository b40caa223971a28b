"""A preallocated KV cache of request slots, and decode steps over it that can be replayed as CUDA graphs.

The dynamic path of the scheduler keeps its running batch in a transformers `DynamicCache`: every decode
step concatenates one column onto every layer's keys and values (a copy of the whole cache), and the
forward pass is launched op by op from Python. On a GPU that makes a decode step of a 0.6B model cost tens
of milliseconds whatever the batch size. Here instead:

- `SlotCache` holds, per layer, keys and values of shape [slots, KV heads, columns, head dim], allocated
  once and grown by doubling when a longer sequence or more rows arrive. Row i of the running batch lives
  in slot i with its tokens at columns 0 .. len_i - 1 (no padding in front), so rows are independent and a
  finished row is replaced by moving the last rows down.
- A decode step writes each row's new key / value at column len_i (an indexed write), attends to columns
  0 .. len_i (a boolean mask built on the device from the lengths) and reads logits of the last position.
  Its shapes depend only on (rows, columns) rounded up to buckets, so on CUDA each bucket is captured
  once as a CUDA graph and replayed: one launch per step instead of hundreds.
- Attention uses the query heads of one KV group as the query positions of a single SDPA call
  (`decode_attention`), so grouped-query models read each KV head once instead of repeating it per group.

The model is any transformers causal LM whose attention layers call `past_key_values.update(k, v,
layer_idx)` and pass a 4-D mask through (`create_causal_mask` returns a 4-D mask unchanged), with full
attention in every layer (`supports_slots` says whether a model qualifies). Parameters must be changed in
place (`copy_`) while graphs exist; moving the model (`.to()`) requires `drop_graphs()` first.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from slime.backends.hf_engine.decode_attention import covered, covers_write, kernel_available, triton_decode_attention

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
COLUMN_BUCKET = 128  # columns are rounded up to a multiple of this (also keeps SDPA's mask aligned)
ATTENTION_NAME = "slime_slot_decode"
ATTENTIONS = ("auto", "sdpa", "triton")  # --decode-attention: SDPA under the mask, or decode_attention.py's kernel


def supports_slots(model) -> tuple[bool, str]:
    """(True, "") when the slot cache can serve `model`, else (False, why)."""
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        return False, "encoder-decoder model"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return False, f"layers other than full attention ({sorted(set(layer_types))})"
    return True, ""


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA for one new token per row. query [B, H, 1, D]; key / value [B, KVH, L, D]; mask [B, 1, 1, L] bool.

    With H = KVH x G, the G query heads sharing a KV head become G query positions of that head, so no
    KV head is repeated. Returns ([B, 1, H, Dv], None) like transformers' attention functions.
    """
    b, h, q, d = query.shape
    kv_heads = key.shape[1]
    groups = h // kv_heads
    if q == 1 and groups > 1:
        query = query.reshape(b, kv_heads, groups, d)
    elif groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


_writing_view: _SlotView | None = None  # the decode step in progress whose KV writes the attention does (fused)


def decode_attention_triton(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`decode_attention` through decode_attention.py's kernel where it covers the call (reading each row's live
    columns only), else SDPA. With the KV writes fused (the default with this attention; --disable-fused-kv-write) the
    step's new key / value, which `_SlotView.update` left unwritten, are stored by the kernel (or by the indexed
    writes, before SDPA, where it does not cover)."""
    write = _writing_view.take_write(module) if _writing_view is not None else None
    if not covered(query, key, value, attention_mask) or (write is not None and not covers_write(key, *write)):
        if write is not None:
            _writing_view.write(key, value, *write)
        return decode_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return triton_decode_attention(query, key, value, attention_mask, scale, write), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, decode_attention)
    AttentionInterface.register(ATTENTION_NAME + "_triton", decode_attention_triton)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device: on CUDA through pinned memory and
    an asynchronous copy (a copy from pageable memory waits until every queued kernel has run, which would stall the
    overlap schedule's host work behind the step in flight)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def bucket_rows(n: int) -> int:
    for size in ROW_BUCKETS:
        if size >= n:
            return size
    return -(-n // 64) * 64


def bucket_columns(n: int) -> int:
    return -(-n // COLUMN_BUCKET) * COLUMN_BUCKET


def grown_columns(allocated: int, needed: int) -> int:
    """Columns of the cache after making room for `needed` when `allocated` are there: at least double, so a
    sequence growing one token at a time reallocates O(log length) times (the --dry-run plan counts the same)."""
    needed = bucket_columns(needed)
    return allocated if needed <= allocated else max(needed, 2 * allocated)


class _SlotView:
    """What the model sees as `past_key_values` during one decode step over rows [0, rows)."""

    def __init__(self, cache: SlotCache, rows: int, columns: int):
        self.cache, self.rows, self.columns = cache, rows, columns
        self.row_index = cache.row_index[:rows]
        self.write_columns = cache.lens[:rows]
        self._unwritten: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (layer, key, value) left to attention

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        self.check_written()
        if self.cache.fused_kv_write:  # the attention function stores them (decode_attention_triton)
            self._unwritten = (layer_idx, key_states, value_states)
        else:
            self.write(k, v, key_states, value_states, self.write_columns)
        return k[: self.rows, :, : self.columns], v[: self.rows, :, : self.columns]

    def write(self, k, v, key_states, value_states, columns) -> None:
        """Each row's new key / value into column `columns[row]` of the layer's cache `k` / `v` (or views of it)."""
        k[self.row_index, :, columns] = key_states[:, :, 0]
        v[self.row_index, :, columns] = value_states[:, :, 0]

    def check_written(self) -> None:
        """Raise when a layer's new key / value, left to its attention (fused KV writes), were not taken."""
        if self._unwritten is not None:
            raise RuntimeError(f"layer {self._unwritten[0]}'s new key / value were not written by its attention")

    def take_write(self, module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The (new key, new value, columns) `update` left for this attention call to write, or None."""
        if self._unwritten is None:
            return None
        layer, key_states, value_states = self._unwritten
        if getattr(module, "layer_idx", layer) != layer:
            raise RuntimeError(f"attention of layer {module.layer_idx} called with layer {layer}'s KV unwritten")
        self._unwritten = None
        return key_states, value_states, self.write_columns

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only asked when position ids are missing
        raise RuntimeError("slot decode passes position ids; the sequence length is per row")


class SlotCache:
    """Per-layer KV buffers [slots, KV heads, columns, head dim] plus the static inputs of a decode step."""

    def __init__(self, model, max_rows: int, cuda_graphs: bool, attention: str = "auto",
                 fused_kv_write: bool | None = None):
        if attention not in ATTENTIONS:
            raise ValueError(f"--decode-attention {attention!r}: one of {list(ATTENTIONS)}")
        _register_attention()
        self.model = model
        self.device = next(model.parameters()).device
        if attention == "auto":  # the kernel where it runs: measured faster than SDPA on an H100 (row 29)
            attention = "triton" if self.device.type == "cuda" and kernel_available() else "sdpa"
        self.attention = attention
        self.attention_name = ATTENTION_NAME + ("_triton" if attention == "triton" else "")
        if fused_kv_write is None:  # the writes in the kernel wherever it attends: measured faster (row 29)
            fused_kv_write = attention == "triton"
        elif fused_kv_write and attention != "triton":
            raise ValueError(f"fused KV writes go into the Triton decode attention, and this slot cache attends with "
                             f"{attention}; use --decode-attention triton on CUDA")
        self.fused_kv_write = fused_kv_write  # each decode step's KV written by the attention kernel
        self.max_rows = max_rows
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0
        self.columns = 0
        # static inputs: token fed at this step, number of cached tokens (= its write column), and what its position
        # is past that count (0 for text; a row with images continues from its 3-D RoPE positions, whose largest is
        # not its count of tokens)
        self.tokens = self.lens = self.offsets = self.row_index = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # One side stream for every capture's warm-up: a new stream per capture would cycle through torch's pool of
        # 32 and give each its own cuBLAS workspace, held for the process's life (~0.1 GB per released step seen
        # on the H200 in the hf engine's memory while released).
        self._warmup_stream = None
        self.stats = {"graphs_captured": 0, "reallocations": 0}

    # ---- memory ----
    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def ensure(self, rows: int, columns: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make room for `rows` slots of `columns` tokens (`like`: one (keys, values) per layer, for shapes)."""
        rows = min(max(bucket_rows(rows), 1), bucket_rows(self.max_rows))
        columns = bucket_columns(columns)
        if self.allocated and rows <= self.slots and columns <= self.columns:
            return
        new_rows = max(rows, self.slots)
        new_columns = grown_columns(self.columns, columns)
        keys, values = [], []
        for i, (k, v) in enumerate(like):
            nk = k.new_zeros(new_rows, k.shape[1], new_columns, k.shape[3])
            nv = v.new_zeros(new_rows, v.shape[1], new_columns, v.shape[3])
            if self.allocated:
                nk[: self.slots, :, : self.columns] = self.keys[i]
                nv[: self.slots, :, : self.columns] = self.values[i]
            keys.append(nk)
            values.append(nv)
        tokens = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        lens = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        offsets = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        if self.allocated:
            tokens[: self.slots] = self.tokens
            lens[: self.slots] = self.lens
            offsets[: self.slots] = self.offsets
            self.stats["reallocations"] += 1
        self.drop_graphs()
        self.keys, self.values, self.tokens, self.lens, self.offsets = keys, values, tokens, lens, offsets
        self.row_index = torch.arange(new_rows, device=self.device)
        self.slots, self.columns = new_rows, new_columns

    def free(self) -> None:
        self.drop_graphs()
        self.keys, self.values = [], []
        self.tokens = self.lens = self.offsets = self.row_index = None
        self.slots = self.columns = 0

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    # ---- rows ----
    def write_prefill(self, first_row: int, kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int],
                      tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a left-padded prefill's KV (rows [n, KVH, P, D]) into slots first_row .. first_row + n - 1;
        `positions`: each row's position of `tokens` (its length, unless the row has images)."""
        n, padded = len(lengths), kv[0][0].shape[2]
        self.ensure(first_row + n, padded + 1, kv)
        lens = torch.tensor(lengths, dtype=torch.long, device=self.device)
        # slot column j <- prefill column P - len + j (columns past the row's length get a harmless copy)
        source = (padded - lens).unsqueeze(1) + torch.arange(padded, device=self.device)
        source = source.clamp_(max=padded - 1)[:, None, :, None]
        rows = slice(first_row, first_row + n)
        for i, (k, v) in enumerate(kv):
            self.keys[i][rows, :, :padded] = k.gather(2, source.expand(-1, k.shape[1], -1, k.shape[3]))
            self.values[i][rows, :, :padded] = v.gather(2, source.expand(-1, v.shape[1], -1, v.shape[3]))
        self.lens[rows] = lens
        self.offsets[rows] = positions.to(self.device) - lens
        self.tokens[rows] = tokens

    def keep_rows(self, keep: list[int], live_columns: int) -> None:
        """Row j becomes old row keep[j] (keep is increasing); only the first `live_columns` columns move."""
        moves = [(j, src) for j, src in enumerate(keep) if src != j]
        if moves:
            dst = to_device([j for j, _ in moves], torch.long, self.device)
            src = to_device([s for _, s in moves], torch.long, self.device)
            c = min(live_columns, self.columns)
            for k, v in zip(self.keys, self.values):
                k[dst, :, :c] = k[src, :, :c]
                v[dst, :, :c] = v[src, :, :c]
            self.lens[dst] = self.lens[src]
            self.offsets[dst] = self.offsets[src]
            self.tokens[dst] = self.tokens[src]

    # ---- one decode step ----
    def decode(self, rows: int, longest: int) -> torch.Tensor:
        """Feed `tokens[:rows]` at positions `lens[:rows] + offsets[:rows]` (cache columns `lens[:rows]`); returns the
        logits [rows, vocab] and advances lens.

        `longest`: the largest len among the rows (host-side, to pick the column bucket without a sync).
        """
        columns = bucket_columns(longest + 1)
        if columns > self.columns:
            self.ensure(self.slots, columns, list(zip(self.keys, self.values)))
        bucket = min(bucket_rows(rows), self.slots)
        if self.cuda_graphs:
            logits = self._replay(bucket, columns)
        else:
            logits = self._forward(bucket, columns)
        self.lens[:rows] += 1
        return logits[:rows]

    def _forward(self, rows: int, columns: int) -> torch.Tensor:
        mask = torch.arange(columns, device=self.device) <= self.lens[:rows].unsqueeze(1)
        view = _SlotView(self, rows, columns)
        with self._decode_attention(view):
            positions = (self.lens[:rows] + self.offsets[:rows]).unsqueeze(1)
            out = self.model(input_ids=self.tokens[:rows].unsqueeze(1), position_ids=positions,
                             attention_mask=mask[:, None, None, :], past_key_values=view,
                             use_cache=True, logits_to_keep=1)
        view.check_written()
        return out.logits[:, -1]

    @contextlib.contextmanager
    def _decode_attention(self, view: _SlotView):
        global _writing_view
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = self.attention_name
        _writing_view = view if self.fused_kv_write else None
        try:
            yield
        finally:
            config._attn_implementation = before
            _writing_view = None

    def _replay(self, rows: int, columns: int) -> torch.Tensor:
        entry = self._graphs.get((rows, columns))
        if entry is None:
            # Warm up on a side stream (as torch's capture requires), then capture. Both run the real step
            # on the real inputs, so the KV they write is what this step writes anyway.
            if self._warmup_stream is None:
                self._warmup_stream = torch.cuda.Stream()
            stream = self._warmup_stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(rows, columns)
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(rows, columns)
            entry = self._graphs[(rows, columns)] = (graph, logits)
            self.stats["graphs_captured"] += 1
        graph, logits = entry
        graph.replay()
        return logits
