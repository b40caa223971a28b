"""Same-host tensor hand-over for `POST /update_weights_from_tensor`, in SGLang's wire format.

A bucket of named tensors is flattened into one contiguous byte buffer (`load_format: "flattened_bucket"`).
The payload of one engine TP rank is what SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`
produces for `obj = {"flattened_tensor": uint8 buffer, "metadata": [FlattenedTensorMetadata, ...]}`: a
pickle written with torch's multiprocessing reducers, base64-encoded. The metadata objects pickle as
`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx,
numel in bytes), so a real SGLang server loads them, and this module writes that name without needing
sglang installed. Each tensor starts on a 16-byte boundary so `view(dtype)` works for any dtype mix.

The pickle carries a handle, not the data: a CUDA IPC handle for GPU tensors, a shared-memory file name
for CPU tensors (the `file_system` sharing strategy, so an unrelated process such as an engine server can
open it). The sender keeps the buffer alive until the receiver has loaded it, i.e. until the HTTP call
returns.

Receiving (`deserialize_bucket`) uses a restricted unpickler: only torch's tensor/storage rebuild
functions, dtypes, sizes and the metadata class are allowed, so a payload cannot name any other callable.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (registers torch reducers on ForkingPickler)

SGLANG_METADATA_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
ALIGN_BYTES = 16


@dataclass
class FlattenedTensorMetadata:
    """Field for field SGLang's class of the same name (byte offsets into the uint8 buffer)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class FlattenedBucket:
    flattened_tensor: torch.Tensor  # 1-D uint8
    metadata: list[FlattenedTensorMetadata]

    def unflatten(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for m in self.metadata:
            raw = self.flattened_tensor[m.start_idx : m.end_idx]
            if m.start_idx % m.dtype.itemsize:  # packed by a sender that does not align (SGLang's own bucket)
                raw = raw.clone()
            out.append((m.name, raw.view(m.dtype).reshape(m.shape)))
        return out


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> FlattenedBucket:
    if not named_tensors:
        raise ValueError("flatten_bucket: empty bucket")
    metadata, parts, offset = [], [], 0
    device = named_tensors[0][1].device
    for name, t in named_tensors:
        pad = -offset % ALIGN_BYTES
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            offset += pad
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + flat.numel(),
                                                flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return FlattenedBucket(torch.cat(parts), metadata)


class _SGLangPickler(pickle._Pickler):
    """ForkingPickler's reducers on the pure-Python pickler, which lets `save_global` write SGLang's
    metadata class name for ours (the C pickler insists on importing the module it names)."""

    def __init__(self, file):
        super().__init__(file, protocol=4)
        self.dispatch_table = {**copyreg.dispatch_table, **ForkingPickler._extra_reducers}

    def save_global(self, obj, name=None):
        if obj is not FlattenedTensorMetadata:
            return super().save_global(obj, name)
        module, qualname = SGLANG_METADATA_GLOBAL
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def serialize_bucket(bucket: FlattenedBucket) -> str:
    """The payload of one TP rank (CPU buffers are moved to shared memory first)."""
    if not bucket.flattened_tensor.is_cuda:
        mp.set_sharing_strategy("file_system")
        bucket.flattened_tensor.share_memory_()
    buf = io.BytesIO()
    _SGLangPickler(buf).dump({"flattened_tensor": bucket.flattened_tensor, "metadata": bucket.metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = {
    ("builtins", n) for n in ("dict", "list", "tuple", "int", "float", "str", "bytes", "bool")
} | {
    ("copyreg", "__newobj__"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
} | {
    (_REDUCTIONS, n) for n in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                               "rebuild_typed_storage_child", "rebuild_storage_filename",
                               "rebuild_storage_empty")
}


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == SGLANG_METADATA_GLOBAL:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        hint = (" (CPU tensors must be shared with torch.multiprocessing.set_sharing_strategy('file_system'))"
                if name in ("rebuild_storage_fd", "DupFd") else "")
        raise pickle.UnpicklingError(f"update_weights_from_tensor payload names {module}.{name}, which is not "
                                     f"a tensor, dtype or bucket metadata; refused{hint}")


def deserialize_bucket(payload: str) -> FlattenedBucket:
    mp.set_sharing_strategy("file_system")
    try:
        obj = _PayloadUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (ValueError, EOFError) as e:  # binascii.Error is a ValueError
        raise ValueError(f"update_weights_from_tensor: payload is not a base64 pickle: {e}") from e
    if not (isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), list)
            and all(isinstance(m, FlattenedTensorMetadata) for m in obj["metadata"])):
        raise TypeError("update_weights_from_tensor: expected {'flattened_tensor': tensor, 'metadata': "
                        f"[FlattenedTensorMetadata, ...]}} (load_format 'flattened_bucket'), got {type(obj).__name__}")
    return FlattenedBucket(obj["flattened_tensor"], obj["metadata"])
