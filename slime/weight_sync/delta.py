"""Both ends of slime's delta weight sync (`--update-weight-mode delta`, over `--update-weight-transport disk`).

Trainer side (`Snapshot`, used by `DeltaPush` in slime/weight_sync/push.py): the first push is a full HF
checkpoint, the baseline, and the trainer keeps a CPU copy of every tensor's bytes. Every later push writes only
the tensors whose bytes changed since the previous push, each encoded per `--update-weight-delta-encoding`:
`xor` (the new bytes XOR the previous bytes: the size of the tensor, must be applied exactly once, on the right
base) or `overwrite` (the changed byte positions, then their new bytes: smaller when few bytes changed,
re-applicable). Both are byte-level, so any dtype goes through unchanged. A manifest (`MANIFEST`, JSON, beside
the shards) lists every tensor of the push with its file, dtype, shape and the checksum of its new bytes
(`--update-weight-delta-checksum`: xxh3-128, blake3 or adler32).

Engine side (`apply_push`, called by `ServerEngine.apply_weight_delta` on the engine's own host): the engine-host
checkpoint `--update-weight-local-checkpoint-dir` is brought to the push. A full push is copied there; a delta
is decoded against the local files. Every new shard goes to a temporary name first and every tensor's checksum is
checked; only when all match are the shards renamed over the old ones, so a mismatch leaves the local
checkpoint (and, since the engine then loads nothing, its weights) as they were. The local folder records which
push it holds (`STATE`): engines sharing a host apply a push once (a flock serialises them), and a delta whose
base is not what the folder holds fails rather than decoding against the wrong bytes.

Simplified against slime: no zstd compression of the encoded bytes; the engine-side apply runs in the engine's
Ray actor (slime's lives in SGLang's `/pull_weights`); a crash between two renames leaves the folder marked as
holding no push (the state is removed before the first rename), so the next delta fails loudly and a full push
(after an engine restart) repairs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch (and safetensors' torch loader) are imported by the functions that use them: every engine actor imports
# this module (ServerEngine.apply_weight_delta) and would otherwise spend ~1.5 s of CPU importing torch, which it
# needs only for a delta push, before it can launch its server.

MANIFEST = "weight_delta.json"
STATE = "slime_weight_state.json"
INDEX = "model.safetensors.index.json"
_LOCK = ".slime_weight_state.lock"
_TMP = ".tmp-"  # temporary names end in .tmp-<id>, never in .safetensors: a loader's glob does not see them
ENCODINGS = ("xor", "overwrite")


class WeightDeltaError(RuntimeError):
    """A push that cannot be applied: a checksum mismatch, a wrong base, a tensor the baseline lacks."""


# ---- checksums -------------------------------------------------------------------------------------------------
def checksum_fn(algorithm: str):
    """`bytes-like -> hex digest` for `--update-weight-delta-checksum`; a missing package names how to install it."""
    if algorithm == "adler32":
        return lambda data: f"{zlib.adler32(data) & 0xFFFFFFFF:08x}"
    if algorithm == "xxh3-128":
        module = _import_hash("xxhash", algorithm)
        return lambda data: module.xxh3_128_hexdigest(data)
    if algorithm == "blake3":
        module = _import_hash("blake3", algorithm)
        return lambda data: module.blake3(data).hexdigest()
    raise ValueError(f"--update-weight-delta-checksum {algorithm!r}: unknown; choose xxh3-128, blake3 or adler32")


def _import_hash(package: str, algorithm: str):
    try:
        return __import__(package)
    except ImportError:
        raise ImportError(f"--update-weight-delta-checksum {algorithm} needs the Python package {package!r}, "
                          f"which is not installed: pip install {package} (or choose adler32)") from None


# ---- encodings -------------------------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`'s bytes as a flat uint8 tensor (any dtype, any shape, 0-dim included)."""
    import torch

    return t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)


def _position_dtype(nbytes: int) -> torch.dtype:
    import torch

    return torch.int32 if nbytes < 2**31 else torch.int64


def encode(new: torch.Tensor, old: torch.Tensor, encoding: str) -> torch.Tensor | None:
    """The encoded change from `old` to `new` (flat uint8, equal lengths), or None when the bytes are equal."""
    import torch

    if new.numel() != old.numel():
        raise WeightDeltaError(f"encode: {new.numel()} bytes against a base of {old.numel()}")
    if torch.equal(new, old):
        return None
    if encoding == "xor":
        return torch.bitwise_xor(new, old)
    if encoding == "overwrite":
        positions = (new != old).nonzero().reshape(-1)
        return torch.cat([positions.to(_position_dtype(new.numel())).view(torch.uint8), new[positions]])
    raise ValueError(f"--update-weight-delta-encoding {encoding!r}: unknown; choose one of {ENCODINGS}")


def decode(encoded: torch.Tensor, old: torch.Tensor, encoding: str) -> torch.Tensor:
    """The new bytes from `old` and `encode(new, old, encoding)`."""
    import torch

    if encoding == "xor":
        if encoded.numel() != old.numel():
            raise WeightDeltaError(f"xor delta of {encoded.numel()} bytes against a base of {old.numel()}")
        return torch.bitwise_xor(encoded, old)
    if encoding == "overwrite":
        dtype = _position_dtype(old.numel())
        width = torch.tensor([], dtype=dtype).element_size()
        count, rest = divmod(encoded.numel(), width + 1)
        if rest:
            raise WeightDeltaError(f"overwrite delta of {encoded.numel()} bytes is not a whole number of "
                                   f"({width}-byte position, value) pairs")
        positions = encoded[:count * width].clone().view(dtype).long()
        if count and int(positions.max()) >= old.numel():
            raise WeightDeltaError(f"overwrite delta names byte {int(positions.max())} of a {old.numel()}-byte tensor")
        new = old.clone()
        new[positions] = encoded[count * width:]
        return new
    raise ValueError(f"--update-weight-delta-encoding {encoding!r}: unknown; choose one of {ENCODINGS}")


# ---- trainer side ----------------------------------------------------------------------------------------------
def _entry(t: torch.Tensor, digest: str) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "checksum": digest}


class Snapshot:
    """The trainer's CPU copy of the bytes of every tensor as of the last push, and the diff of a push against it."""

    def __init__(self, encoding: str, algorithm: str):
        if encoding not in ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding {encoding!r}: unknown; choose one of {ENCODINGS}")
        self.encoding, self.algorithm = encoding, algorithm
        self.checksum = checksum_fn(algorithm)
        self.base: dict[str, torch.Tensor] = {}
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def clear(self) -> None:
        """Forget the base: the next push must be a full one (after a failed push, or an engine was replaced)."""
        self.base, self.meta = {}, {}

    def record(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        """A full push of CPU `tensors`: they become the base. Returns their manifest entries."""
        import torch

        entries = {}
        for name, t in tensors.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            self.base[name], self.meta[name] = raw, (t.dtype, tuple(t.shape))
            entries[name] = _entry(t, self.checksum(raw.numpy()))
        return entries

    def diff(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """The encoded tensors of `bucket` whose bytes changed, and their manifest entries; the base takes the new
        bytes (a push that then fails must `clear` it)."""
        encoded, entries = {}, {}
        for name, t in bucket:
            if name not in self.base:
                raise WeightDeltaError(f"--update-weight-mode delta: tensor {name!r} is not in the baseline push; "
                                       "the pushed tensors must be the same at every push")
            if self.meta[name] != (t.dtype, tuple(t.shape)):
                raise WeightDeltaError(f"--update-weight-mode delta: tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                                       f"the baseline had {self.meta[name][0]} {self.meta[name][1]}")
            new = tensor_bytes(t)
            change = encode(new, self.base[name], self.encoding)
            if change is None:
                continue
            encoded[name] = change
            entries[name] = _entry(t, self.checksum(new.numpy()))
            self.base[name] = new
        return encoded, entries


def manifest(kind: str, version: str, base_id: str | None, encoding: str, algorithm: str,
             tensors: dict[str, dict], total_bytes: int) -> dict[str, Any]:
    """A push's manifest: `kind` full|delta, a fresh `push_id`, the `base_id` a delta applies on top of."""
    return {"kind": kind, "version": str(version), "push_id": uuid.uuid4().hex, "base_id": base_id,
            "encoding": encoding, "checksum": algorithm, "total_bytes": total_bytes, "tensors": tensors}


def write_json(path: str, obj: Any) -> None:
    """Write `obj` to a temporary name, then rename: a reader sees the old file or the whole new one."""
    tmp = f"{path}{_TMP}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(push_dir: str) -> dict[str, Any]:
    path = os.path.join(push_dir, MANIFEST)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise WeightDeltaError(f"{path}: no manifest; the folder is not a --update-weight-mode delta push") from None


# ---- engine side -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _host_lock(local_dir: str) -> Iterator[None]:
    with open(os.path.join(local_dir, _LOCK), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def local_push_id(local_dir: str) -> str | None:
    """The push the local checkpoint holds (None: none, or interrupted while replacing files)."""
    try:
        with open(os.path.join(local_dir, STATE)) as f:
            return json.load(f)["push_id"]
    except FileNotFoundError:
        return None


def apply_push(push_dir: str, local_dir: str) -> dict[str, Any]:
    """Bring `local_dir` to the push in `push_dir` (the module docstring). Returns what was done:
    {"version", "kind", "applied": False when the folder held it already, "tensors": tensors written}."""
    m = read_manifest(push_dir)
    os.makedirs(local_dir, exist_ok=True)
    with _host_lock(local_dir):
        held = local_push_id(local_dir)
        done = {"version": m["version"], "kind": m["kind"], "applied": False, "tensors": 0}
        if held == m["push_id"]:
            return done  # another engine on this host applied it
        if m["kind"] == "delta" and held != m["base_id"]:
            raise WeightDeltaError(
                f"weight push v{m['version']} ({push_dir}) is a delta on top of push {m['base_id']}, but the local "
                f"checkpoint {local_dir} holds {held or 'no complete push'}; the trainer sends a full push again "
                "after an engine restart or a failed push")
        staged = _stage_full(push_dir, local_dir, m) if m["kind"] == "full" else _stage_delta(push_dir, local_dir, m)
        _commit(local_dir, staged, m, remove_others=m["kind"] == "full")
        done.update(applied=True, tensors=len(m["tensors"]))
        return done


def _mismatch(m: dict, name: str, expected: str, got: str) -> WeightDeltaError:
    return WeightDeltaError(
        f"weight push v{m['version']}: {m['checksum']} checksum mismatch for tensor {name!r}: the push says "
        f"{expected}, the applied bytes give {got}; nothing was applied (the local checkpoint and the engine's "
        "weights are unchanged)")


def _stage_full(push_dir: str, local_dir: str, m: dict) -> dict[str, str]:
    """Copy the push's files to temporary names in `local_dir`, checking every tensor; returns final -> temp."""
    import torch
    from safetensors.torch import load_file

    checksum = checksum_fn(m["checksum"])
    tag = _TMP + m["push_id"][:8]
    staged: dict[str, str] = {}
    try:
        for src in sorted(os.listdir(push_dir)):
            if src == MANIFEST or not os.path.isfile(os.path.join(push_dir, src)):
                continue
            tmp = os.path.join(local_dir, src + tag)
            shutil.copyfile(os.path.join(push_dir, src), tmp)
            staged[src] = tmp
            if src.endswith(".safetensors"):
                for name, t in load_file(tmp).items():
                    if name not in m["tensors"]:
                        raise WeightDeltaError(f"weight push v{m['version']}: {src} holds tensor {name!r}, which "
                                               f"its manifest {os.path.join(push_dir, MANIFEST)} does not list")
                    got = checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                    if got != m["tensors"][name]["checksum"]:
                        raise _mismatch(m, name, m["tensors"][name]["checksum"], got)
    except BaseException:
        _discard(staged)
        raise
    return staged


def _stage_delta(push_dir: str, local_dir: str, m: dict) -> dict[str, str]:
    """Decode the changed tensors against the local shards, write each touched shard to a temporary name and
    check every changed tensor's checksum; returns final -> temp."""
    import torch
    from safetensors.torch import load_file, save_file

    checksum = checksum_fn(m["checksum"])
    tag = _TMP + m["push_id"][:8]
    with open(os.path.join(local_dir, INDEX)) as f:
        where = json.load(f)["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for name in m["tensors"]:
        if name not in where:
            raise WeightDeltaError(f"weight push v{m['version']}: tensor {name!r} is not in the local checkpoint "
                                   f"{local_dir} ({INDEX})")
        by_shard.setdefault(where[name], []).append(name)
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    staged: dict[str, str] = {}
    try:
        for shard, names in sorted(by_shard.items()):
            tensors = load_file(os.path.join(local_dir, shard))
            for name in names:
                entry = m["tensors"][name]
                old = tensors[name]
                if [str(old.dtype).removeprefix("torch."), list(old.shape)] != [entry["dtype"], entry["shape"]]:
                    raise WeightDeltaError(f"weight push v{m['version']}: tensor {name!r} is {entry['dtype']} "
                                           f"{entry['shape']} in the push, {old.dtype} {list(old.shape)} locally")
                if entry["file"] not in deltas:
                    deltas[entry["file"]] = load_file(os.path.join(push_dir, entry["file"]))
                new = decode(deltas[entry["file"]][name], old.contiguous().reshape(-1).view(torch.uint8), m["encoding"])
                got = checksum(new.numpy())
                if got != entry["checksum"]:
                    raise _mismatch(m, name, entry["checksum"], got)
                tensors[name] = new.view(old.dtype).reshape(old.shape)
            tmp = os.path.join(local_dir, shard + tag)
            staged[shard] = tmp
            save_file(tensors, tmp, metadata={"format": "pt"})
    except BaseException:
        _discard(staged)
        raise
    return staged


def _discard(staged: dict[str, str]) -> None:
    for tmp in staged.values():
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _commit(local_dir: str, staged: dict[str, str], m: dict, remove_others: bool) -> None:
    """Everything checked: rename the staged files into place, then record the push as held."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(local_dir, STATE))
    for final, tmp in staged.items():
        os.replace(tmp, os.path.join(local_dir, final))
    if remove_others:  # a full push: shards of an older layout must not be loaded with the new ones
        for path in glob.glob(os.path.join(local_dir, "*.safetensors")):
            if os.path.basename(path) not in staged:
                os.remove(path)
    write_json(os.path.join(local_dir, STATE), {"push_id": m["push_id"], "version": m["version"]})
