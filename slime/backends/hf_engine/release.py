"""The memory of a model's weights, released and taken back (the hf engine's `weights` memory tag).

SGLang's memory saver frees released weights and gives their memory back uninitialised on resume: the trainer
pushes a complete set of weights right after resuming them. With `--enable-weights-cpu-backup` it keeps a host
copy instead and copies it back. `WeightMemory` does the same for a torch module, in one of three modes:

- `free`: `release()` points every parameter at an empty tensor of its dtype on its device. The Parameter objects
  stay (the engine's name table, modules sharing a tied parameter, the weight loaders keep their references);
  nothing holds the old storages any more and the allocator takes them back. `resume()` gives every storage fresh,
  uninitialised memory of its size on its device and points the parameters back into it. Until every parameter
  has been written again (`mark_loaded`; a parameter loaded in pieces, `mark_part_loaded`, once every piece has
  been), `unloaded` names the ones that have not.
- `cpu_backup`: the same, but the bytes are first copied into host buffers and copied back on resume. The host
  buffers are fixed-size chunks (pinned when the device is CUDA, by slime.utils.pinned: exact size, paged in by
  several threads), allocated on the first release and reused.
- `base_backup`: for a LoRA engine whose base is frozen: the host copy is taken once (`snapshot`, at the first
  release or the first adapter load, whichever comes first) and a release copies nothing; a resume copies it back,
  so the weights come back as the base, whatever adapter was merged into them (lora.py merges it again). The host
  copy is the base the adapter merges read (`restore_params`), so the engine holds no device copy of it. A
  full-weight load makes a new base (`changed`): the next snapshot takes it.
- `keep`: nothing is freed (a CPU engine has nowhere cheaper to put its weights); only `released` changes.

Storages, not parameters, are what is freed and re-allocated: a tied parameter (embed_tokens and lm_head, one
Parameter under two names) is one storage, and parameters that are views of one storage are views of one new
storage after a resume. The storages' sizes and each parameter's place in its storage (offset, shape, stride) are
recorded once, at construction; no reference to a storage is kept. Buffers (rotary `inv_freq`, ...) are never
touched: they are derived from the config, small, and never pushed (SGLang saves and restores them around a
release for that reason). A parameter whose storage a buffer shares stays resident (freeing it would not free the
memory, and a new storage would part it from the buffer).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from slime.utils.pinned import pinned_empty

logger = logging.getLogger("slime.hf_engine")

MODES = ("free", "cpu_backup", "base_backup", "keep")
HOST_COPY_MODES = ("cpu_backup", "base_backup")
HOST_CHUNK_BYTES = 1 << 28  # 256 MiB per host buffer


@dataclass(frozen=True)
class _View:
    """Where one parameter lives in its storage."""

    name: str
    param: torch.nn.Parameter
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Storage:
    device: torch.device
    nbytes: int
    views: list[_View] = field(default_factory=list)


class WeightMemory:
    """Releases and re-takes the parameter memory of `module` (see the module docstring for the modes)."""

    def __init__(self, module: torch.nn.Module, mode: str):
        if mode not in MODES:
            raise ValueError(f"weight release mode {mode!r}: choose one of {list(MODES)}")
        self.mode = mode
        buffer_storages = {(b.device, b.untyped_storage().data_ptr()) for b in module.buffers() if b.numel()}
        storages: dict[tuple[torch.device, int], _Storage] = {}
        self.resident: list[str] = []  # parameters sharing a buffer's storage: never freed
        for name, p in module.named_parameters():  # each Parameter once, under its first name
            key = (p.device, p.untyped_storage().data_ptr())
            if p.numel() and key in buffer_storages:
                self.resident.append(name)
                continue
            entry = storages.setdefault(key, _Storage(p.device, p.untyped_storage().nbytes()))
            entry.views.append(_View(name, p, p.dtype, p.storage_offset(), tuple(p.shape), tuple(p.stride())))
        if self.resident:
            logger.warning("parameters %s share storage with a buffer: they stay resident when weights are released",
                           self.resident)
        self._storages = list(storages.values())
        self._starts = []  # each storage's first byte in the host layout (storages laid end to end)
        self._where: dict[int, tuple[int, _View]] = {}  # id(Parameter) -> (its storage's index, its view)
        pos = 0
        for i, s in enumerate(self._storages):
            self._starts.append(pos)
            pos += s.nbytes
            self._where.update({id(v.param): (i, v) for v in s.views})
        self._host: list[torch.Tensor] = []  # cpu_backup / base_backup: the chunks, allocated on the first copy
        self._host_fresh = False  # base_backup: the host copy holds the current base
        self.host_copies = 0  # copies taken to the host (base_backup: one per base)
        self.released = False
        self._unloaded: dict[int, str] = {}  # id(Parameter) -> name, while resumed uninitialised
        self._parts: dict[int, set[str]] = {}  # id(Parameter) -> its parts written since the resume (mark_part_loaded)

    @property
    def nbytes(self) -> int:
        """Bytes a release frees (the distinct storages of the parameters)."""
        return sum(s.nbytes for s in self._storages)

    @property
    def freed(self) -> bool:
        """True while the parameters have no memory (released in a mode that frees it)."""
        return self.released and self.mode != "keep"

    @property
    def unloaded(self) -> list[str]:
        """Parameters not written since they came back uninitialised (empty when the weights are whole)."""
        return sorted(list(self._unloaded.values()))

    @property
    def complete(self) -> bool:
        """Every parameter holds loaded values (false from a `free` resume until each has been written)."""
        return not self._unloaded

    @property
    def count(self) -> int:
        """Distinct parameters (a tied one once)."""
        return sum(len(s.views) for s in self._storages) + len(self.resident)

    def release(self) -> int:
        """Free the parameters' memory (`cpu_backup`: after copying it to the host); returns the bytes freed."""
        if self.released:
            return 0
        if self.mode == "cpu_backup":
            self._copy_to_host()
        elif self.mode == "base_backup":
            self.snapshot()
        if self.mode != "keep":
            for s in self._storages:
                for v in s.views:
                    v.param.data = torch.empty(0, dtype=v.dtype, device=s.device)
        self.released = True
        return 0 if self.mode == "keep" else self.nbytes

    def resume(self) -> int:
        """Memory again for every parameter (`cpu_backup`: with the saved values; `free`: uninitialised, and every
        parameter is in `unloaded` until written); returns the bytes allocated."""
        if not self.released:
            return 0
        if self.mode != "keep":
            for s in self._storages:
                storage = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device).untyped_storage()
                for v in s.views:
                    v.param.data = torch.empty(0, dtype=v.dtype, device=s.device).set_(storage, v.offset, v.size,
                                                                                        v.stride)
            if self.mode in HOST_COPY_MODES:
                self._copy_from_host()
            else:
                self._unloaded = {id(v.param): v.name for s in self._storages for v in s.views}
                self._parts = {}
        self.released = False
        return 0 if self.mode == "keep" else self.nbytes

    def mark_loaded(self, tensors) -> None:
        """These tensors (the module's own parameter objects; others are ignored) hold loaded values now."""
        for t in tensors:
            self._unloaded.pop(id(t), None)
            self._parts.pop(id(t), None)

    def mark_part_loaded(self, param, part: str, count: int) -> None:
        """`part` of the parameter `param` (a named piece of it, one of the `count` pieces that make it up) holds
        loaded values now; the parameter is loaded once all `count` have been written since the resume."""
        key = id(param)
        if key not in self._unloaded:
            return
        done = self._parts.setdefault(key, set())
        done.add(part)
        if len(done) >= count:
            self.mark_loaded([param])

    # ---- base_backup ----
    def snapshot(self) -> None:
        """base_backup: copy the weights (the base: no adapter merged) to the host unless the copy holds them."""
        if self.mode != "base_backup":
            raise ValueError(f"snapshot: the weights are released in mode {self.mode!r}; only base_backup keeps a "
                             "host copy of the base")
        if self._host_fresh:
            return
        if self.released:
            raise ValueError("snapshot: the weights are released; resume them first")
        start = time.perf_counter()
        self._copy_to_host()
        self._host_fresh = True
        logger.info("weights: host copy of the base taken (%.3f GB, %.3f s); releases copy nothing until the next "
                    "full-weight load", self.nbytes / 1e9, time.perf_counter() - start)

    def changed(self) -> None:
        """The weights were loaded anew (a full-weight push): they are the base the next snapshot copies."""
        self._host_fresh = False

    def restore_params(self, params) -> None:
        """base_backup: copy the host copy of these parameters (the module's own objects) back into them."""
        if not self._host_fresh:
            raise ValueError("restore_params: no host copy of the current base (snapshot first)")
        ranges = []
        for p in params:
            i, v = self._where[id(p)]
            if p.is_contiguous():
                size = v.dtype.itemsize
                ranges.append((i, v.offset * size, p.numel() * size))
            else:  # a strided view: its whole storage (every parameter in it is base too)
                ranges.append((i, 0, self._storages[i].nbytes))
        for i, start, chunk, at, n in self._segments(ranges):
            self._bytes(i)[start:start + n].copy_(self._host[chunk][at:at + n], non_blocking=True)
        self._synchronize()

    # ---- the host copy ----
    def _segments(self, ranges=None):
        """(storage index, start in it, host chunk index, start in the chunk, length) over `ranges` ((storage
        index, first byte, bytes); None: every storage whole): the storages laid end to end over the chunks, a
        range split where a chunk ends."""
        if ranges is None:
            ranges = [(i, 0, s.nbytes) for i, s in enumerate(self._storages)]
        for i, first, nbytes in ranges:
            start, pos = first, self._starts[i] + first
            while start < first + nbytes:
                chunk, at = divmod(pos, HOST_CHUNK_BYTES)
                n = min(first + nbytes - start, HOST_CHUNK_BYTES - at)
                yield i, start, chunk, at, n
                start += n
                pos += n

    def _bytes(self, i: int) -> torch.Tensor:
        """Storage i's current memory as a flat uint8 tensor."""
        s = self._storages[i]
        return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s.views[0].param.untyped_storage())

    def _copy_to_host(self) -> None:
        if not self._host:
            pin = any(s.device.type == "cuda" for s in self._storages)
            sizes = [min(HOST_CHUNK_BYTES, self.nbytes - at) for at in range(0, self.nbytes, HOST_CHUNK_BYTES)]
            self._host = [pinned_empty((n,), torch.uint8) if pin else torch.empty(n, dtype=torch.uint8)
                          for n in sizes]
        for i, start, chunk, at, n in self._segments():
            self._host[chunk][at:at + n].copy_(self._bytes(i)[start:start + n], non_blocking=True)
        self._synchronize()
        self.host_copies += 1

    def _copy_from_host(self) -> None:
        for i, start, chunk, at, n in self._segments():
            self._bytes(i)[start:start + n].copy_(self._host[chunk][at:at + n], non_blocking=True)
        self._synchronize()

    def _synchronize(self) -> None:
        for device in {s.device for s in self._storages if s.device.type == "cuda"}:
            torch.cuda.synchronize(device)
