"""`POST /weights_checker` of the hf engine: prove that a weight push reaches every parameter.

SGLang's endpoint of the same name, which slime's `--check-weight-update-equal` drives (docs/hf_engine.md):

- `snapshot`: keep a CPU copy of every parameter and buffer;
- `reset_tensors`: overwrite them with random values, so only a push that covers every tensor restores them;
- `compare`: fail unless every tensor equals its snapshot bit for bit, naming each one that differs;
- `checksum` (SGLang's default action): a hash per tensor and one over all of them.

Non-persistent buffers (rotary `inv_freq` and the like) are derived from the config, never pushed: as in
SGLang they are neither reset nor compared. The engine's `EngineState.params` (parameters and buffers by
name, tied ones under every name) is what is snapshotted and compared.
"""

from __future__ import annotations

import hashlib

import torch

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32")  # SGLang's list


def is_derived(name: str) -> bool:
    """A buffer computed from the config (not loaded, never pushed): skipped by reset and compare."""
    return any(p in name for p in NON_PERSISTENT_PATTERNS)


class WeightChecker:
    """Holds the snapshot between `snapshot` and `compare`; `handle` returns SGLang's answer payload (or None)."""

    def __init__(self, params: dict[str, torch.Tensor], seed: int = 0):
        self.params = params
        self.snapshot_tensors: dict[str, torch.Tensor] | None = None
        self.seed = seed

    def handle(self, action: str) -> dict | None:
        if action == "snapshot":
            self.snapshot_tensors = {n: t.detach().to("cpu", copy=True) for n, t in self.params.items()}
            return None
        if action == "reset_tensors":
            self.reset()
            return None
        if action == "compare":
            self.compare()
            return None
        if action == "checksum":
            return self.checksum()
        raise ValueError(f"Unsupported action={action!r}; choose one of {list(ACTIONS)}")

    def reset(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, t in self.params.items():
                if is_derived(name):
                    continue
                t.copy_(random_like(t, gen))

    def compare(self) -> None:
        if self.snapshot_tensors is None:
            raise RuntimeError("compare needs a snapshot first: POST /weights_checker {\"action\": \"snapshot\"}")
        errors = []
        for name, actual in self.params.items():
            if is_derived(name):
                continue
            expect = self.snapshot_tensors.get(name)
            if expect is None:
                errors.append(f"name={name} is not in the snapshot")
                continue
            diff = (actual.detach().to("cpu").float() - expect.float()).abs()
            if torch.all(diff == 0):
                continue
            errors.append(f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                          f"num_exceed={int((~(diff <= 0)).sum())} shape={tuple(actual.shape)} dtype={actual.dtype}")
        if errors:
            raise RuntimeError("check tensor equality failed:\n" + "\n".join(errors))

    def checksum(self) -> dict:
        sums = {n: hashlib.sha256(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                .hexdigest()[:16] for n, t in self.params.items() if not is_derived(n)}
        h = hashlib.sha256()
        for name in sorted(sums):
            h.update(name.encode())
            h.update(sums[name].encode())
        overall = h.hexdigest()
        info = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": 0, "size": 1}
        ranks = [{"checksums": sums, "per_gpu_checksum": overall, "parallelism_info": info}]
        return {"ranks": ranks, "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest()}


def random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values of t's shape and dtype (on CPU; copy_ moves them to t's device)."""
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, generator=gen, dtype=t.dtype)
