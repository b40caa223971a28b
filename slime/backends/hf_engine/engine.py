"""`HFEngine`: the `ServerEngine` that launches the built-in hf engine server (server.py).

Launch settings come from slime's args: `--hf-checkpoint` (model), `--seed` + rank (the seed of requests sent
without a `sampling_seed`, as SGLang's `--random-seed`), `--sglang-server-concurrency` (largest running batch),
`--sglang-disable-cuda-graph` (decode steps run eagerly), `--sglang-disable-radix-cache` (no prompt shared between
requests: each prefilled itself), `--sglang-enable-deterministic-inference` (batch-invariant: one request at a
time, each alone), `--sglang-enable-weights-cpu-backup` (released weights are kept in host memory instead of freed);
a LoRA run whose engines release their weights (`--lora-rank` with `--offload-rollout`, on with `--colocate`) starts
it with `--lora-base-cpu-backup` (one host copy of the frozen base, restored on every resume: release.py).
Device is CUDA when the run has it (`args.use_cuda`: the manager then gives the engine a GPU), else CPU; dtype is float32 on CPU (so engine and trainer log-probs agree to ~1e-5) and
bfloat16 on CUDA. Torch threads per server: env `SLIME_ENGINE_NUM_THREADS` (default 1, so several
engines and a trainer can share a small CPU machine). Env `SLIME_ENGINE_RELEASE_MEMORY_ON_CPU=1` starts CPU servers
with `--release-memory-on-cpu` (a release frees the weights as on CUDA; for tests of that path without a GPU).
`--engine-api-key` reaches the server in its environment (SLIME_ENGINE_API_KEY, never on its command line, which
`ps` shows to every user of the node); without it the variable is removed, so a server never requires a key the
job's clients do not send.
"""

from __future__ import annotations

import os
import sys

from slime.backends.hf_engine.auth import API_KEY_ENV
from slime.backends.server_engine import ServerEngine
from slime.backends.sglang_utils.arguments import as_bool, flag_of
from slime.utils.lora_adapter import engine_keeps_base_on_host

def weight_dirs(args) -> list[str]:
    """Folders the server may load weights from (update_weights_from_disk): the one holding --hf-checkpoint,
    --save, the weight-sync folders (--update-weight-disk-dir, --update-weight-local-checkpoint-dir) and any listed
    in SLIME_ENGINE_WEIGHT_DIRS (os.pathsep-separated)."""
    dirs = [os.path.dirname(os.path.abspath(str(args.hf_checkpoint)))]
    for given in (args.save, getattr(args, "update_weight_disk_dir", None),
                  getattr(args, "update_weight_local_checkpoint_dir", None)):
        if given:
            dirs.append(os.path.abspath(given))
    dirs += [d for d in os.environ.get("SLIME_ENGINE_WEIGHT_DIRS", "").split(os.pathsep) if d]
    return dirs


def _env_on(name: str) -> bool:
    """An environment switch as a bool (unset: False); a value that is no boolean names the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return False
    try:
        return as_bool(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}: {e}") from None


def _flag_on(sglang_args: dict, field: str) -> bool:
    """A forwarded `--sglang-<field>` as a bool (absent: False); a value that is no boolean names the flag."""
    if sglang_args.get(field) is None:
        return False
    try:
        return as_bool(sglang_args[field])
    except ValueError as e:
        raise ValueError(f"{flag_of(field)}: {e}") from None


class HFEngine(ServerEngine):
    name = "hf-engine"

    def launch_command(self, host: str, port: int) -> list[str]:
        checkpoint = self.args.hf_checkpoint
        if not checkpoint:
            raise ValueError("--hf-checkpoint is required for the hf rollout engine (an HF model folder)")
        # The rollout manager gives engines GPUs exactly when args.use_cuda; asking torch here instead would import
        # it (~1.5 s of CPU) in an actor that needs it for nothing else, before its server can start.
        cuda = bool(self.args.use_cuda)
        sglang_args = self.args.sglang_args
        seed = self.args.seed + self.rank  # as SGLang's --random-seed: for requests sent without a sampling_seed
        return [sys.executable, "-m", "slime.backends.hf_engine",
                "--model-path", str(checkpoint), "--host", host, "--port", str(port),
                "--device", "cuda" if cuda else "cpu", "--dtype", "bfloat16" if cuda else "float32",
                "--max-running-requests", str(self.args.sglang_server_concurrency),
                "--random-seed", str(seed),
                "--num-threads", os.environ.get("SLIME_ENGINE_NUM_THREADS", "1"),
                *(["--disable-cuda-graph"] if _flag_on(sglang_args, "disable_cuda_graph") else []),
                *(["--disable-shared-prefill"] if _flag_on(sglang_args, "disable_radix_cache") else []),
                *(["--disable-overlap-schedule"] if _flag_on(sglang_args, "disable_overlap_schedule") else []),
                *(["--enable-deterministic-inference"] if _flag_on(sglang_args, "enable_deterministic_inference")
                  else []),
                *(["--enable-weights-cpu-backup"] if _flag_on(sglang_args, "enable_weights_cpu_backup") else []),
                *(["--lora-base-cpu-backup"] if engine_keeps_base_on_host(self.args) else []),
                *(["--release-memory-on-cpu"] if not cuda and _env_on("SLIME_ENGINE_RELEASE_MEMORY_ON_CPU") else []),
                "--weight-dirs", *weight_dirs(self.args)]

    def launch_env(self) -> dict[str, str]:
        env = super().launch_env()
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.pop(API_KEY_ENV, None)
        if self.args.engine_api_key:
            env[API_KEY_ENV] = self.args.engine_api_key
        return env
