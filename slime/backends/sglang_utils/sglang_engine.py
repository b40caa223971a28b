"""`SGLangEngine`: the `ServerEngine` that launches a real SGLang server (`python -m sglang.launch_server`).

Used as a Ray actor like `HFEngine` (`ray.remote(SGLangEngine).options(...).remote(args, rank)`), one per
engine, or per node of a multi-node engine. It computes the server's arguments from slime's flags:

| ServerArgs field | from |
| --- | --- |
| `model_path` | `--hf-checkpoint` |
| `tp_size` | `--rollout-num-gpus-per-engine` |
| `base_gpu_id` | the first GPU Ray gave this actor (its placement-group bundle); 0 outside Ray |
| `port`, `nccl_port` | free ports on this node, picked at launch |
| `random_seed` | `--seed` + engine rank |
| `enable_memory_saver` | `--offload-rollout` (on with `--colocate`: the engines release their memory to the trainer) |
| `skip_server_warmup`, `trust_remote_code` | always on |
| `api_key` | `--engine-api-key` (when set; shown as `--api-key ***` in the engine's log) |
| `enable_lora`, `max_lora_rank`, `lora_target_modules` | `--lora-rank` > 0: on, the rank, `--target-modules` (`all` for all-linear) |
| `enable_weights_cpu_backup` | `--lora-rank` > 0 with `--offload-rollout` (on with `--colocate`): a push sends only the adapter, so the released base must come back from host memory on resume |
| `dist_init_addr`, `nnodes`, `node_rank` | engines wider than `--num-gpus-per-node`: one actor per node |
| anything else | every `--sglang-<flag>` (resolved and checked against the installed SGLang's flags) |

and waits for `GET /health_generate` (a real one-token generation), quoting the tail of the server's log
if it exits first. Control calls (weights, memory, pause, abort) are the base class's HTTP calls.

LoRA pushes: SGLang refuses to load an adapter under a name it holds, and `/load_lora_adapter_from_tensors` takes
no weight version, so a push unloads the adapter this engine loaded last, loads the new one and then restamps the
version (`/update_weight_version`, without aborting requests). The rollout's requests name the adapter in
`lora_path`; between the unload and the load a request naming it would fail, so pushes run while the rollout is
not generating (the training loops pause it around every push).

The server's environment gets slime's defaults (`SERVER_ENV_DEFAULTS`: /health answers without generating, no TP
memory-imbalance check, ...) unless they are set already.

Launcher: env `SLIME_SGLANG_LAUNCHER` (a shell-split command, e.g. `"sglang serve"`), else the class
attribute `launcher`, else `python -m sglang.launch_server`; only the default launcher needs sglang
importable here (without it `launch_command` raises, naming the package). With a custom launcher the
forwarded flags are rendered by name, unchecked.

Assumptions and simplifications:
- GPUs: the server is started with Ray's `CUDA_VISIBLE_DEVICES` removed, so it sees the node's GPUs
  and `base_gpu_id` is a physical id; the engine's other GPUs are taken to be the next ids (slime's
  placement group sorts bundles by GPU id, so an engine's bundles are consecutive GPUs of one node).
- Multi-node engines: node rank 0 owns the HTTP server, picks `dist_init_addr` (`get_dist_init_addr`,
  handed to the other nodes' actors by whoever creates them) and takes every control call; the actors
  of node ranks > 0 only run their server process (`init` returns None, control calls do nothing).
- Registration with sglang-router is done by the RolloutManager with the URL `init` returns.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import sys
import time
from typing import Any

from slime.backends.server_engine import ServerEngine
from slime.backends.sglang_utils.arguments import (
    INSTALL_HINT,
    convert_sglang_args,
    server_fields,
    sglang_cli_args,
)
from slime.utils.lora_adapter import engine_keeps_base_on_host, engine_target_modules
from slime.utils.net import free_port
from slime.utils.placement import engine_nnodes

logger = logging.getLogger(__name__)

LAUNCHER_ENV = "SLIME_SGLANG_LAUNCHER"
# The environment slime gives its SGLang servers. SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: GET /health answers
# without generating a token (sglang-router probes /health; a generation on an engine whose KV cache is released
# for the colocated trainer crashes its scheduler); no TP memory-imbalance check (a colocated trainer holds memory
# on some GPUs). slime also sets SGLANG_MEMORY_SAVER_CUDA_GRAPH=true, which needs torch_memory_saver's LD_PRELOAD
# hook mode (with the default hook SGLang's scheduler fails its assertion at start-up): not set here.
# SGLANG_VLM_CACHE_SIZE_MB=0: no cache of vision-tower outputs keyed by the image; a weight push and /flush_cache
# leave that cache alone (SGLang 0.5.16), so an image seen before a push would keep the old tower's features.
SERVER_ENV_DEFAULTS = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
    "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_JIT_DEEPGEMM_FAST_WARMUP": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    "SGLANG_VLM_CACHE_SIZE_MB": "0",
}
DEFAULT_LAUNCHER = (sys.executable, "-m", "sglang.launch_server")
FOLLOWER_SETTLE_S = 3.0  # a node-rank > 0 server that survives this long is taken as started


def ray_gpu_ids() -> list[int]:
    """The GPU ids Ray assigned to the calling actor ([] outside Ray, without GPUs, or for non-numeric ids)."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        ids = ray.get_gpu_ids()
    except Exception:  # noqa: BLE001 (not in a Ray worker)
        return []
    try:
        return sorted(int(i) for i in ids)
    except (TypeError, ValueError):  # UUIDs: leave GPU selection to CUDA_VISIBLE_DEVICES
        return []


class SGLangEngine(ServerEngine):
    name = "sglang"
    health_path = "/health_generate"
    health_probe_timeout_s = 30.0  # the first generation of a big model can take a while
    startup_timeout_s = 1800.0  # loading and capturing CUDA graphs of large models takes minutes
    launcher: list[str] | None = None

    def __init__(self, args, rank: int, node_rank: int = 0, dist_init_addr: str | None = None):
        super().__init__(args, rank)
        self.nnodes = engine_nnodes(args)
        if not 0 <= node_rank < self.nnodes:
            raise ValueError(f"node_rank {node_rank}: engine {rank} spans {self.nnodes} node(s)")
        self.node_rank = node_rank
        self.tp_size = args.rollout_num_gpus_per_engine
        self._dist_init_addr = dist_init_addr
        self.nccl_port: int | None = None
        self.gpu_ids = ray_gpu_ids()
        self.loaded_adapter: str | None = None  # the adapter name this engine's last push loaded

    # ---- multi-node ----
    def get_dist_init_addr(self) -> str:
        """`host:port` the nodes of this engine rendezvous at; node rank 0 picks it on first use."""
        if self._dist_init_addr is None:
            if self.node_rank != 0:
                raise ValueError(f"engine {self.rank} node rank {self.node_rank}: pass dist_init_addr from node "
                                 "rank 0's get_dist_init_addr()")
            self._dist_init_addr = f"{self.host}:{free_port(self.host)}"
        return self._dist_init_addr

    # ---- arguments ----
    def launcher_command(self) -> list[str]:
        env = os.environ.get(LAUNCHER_ENV)
        if env:
            return shlex.split(env)
        if self.launcher:
            return list(self.launcher)
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError(f"--rollout-backend sglang: the sglang package is not installed on {self.host}; "
                               f"{INSTALL_HINT}")
        return list(DEFAULT_LAUNCHER)

    def uses_default_launcher(self) -> bool:
        return not os.environ.get(LAUNCHER_ENV) and not self.launcher

    def server_args(self, host: str, port: int) -> dict[str, Any]:
        """ServerArgs field -> value for this engine: slime's computed fields, then the forwarded ones as
        `args.sglang_args` holds them."""
        return {**self.computed_args(host, port), **self.args.sglang_args}

    def computed_args(self, host: str, port: int) -> dict[str, Any]:
        """The ServerArgs fields slime computes for this engine (picks a fresh `nccl_port`)."""
        args = self.args
        checkpoint = args.hf_checkpoint
        if not checkpoint:
            raise ValueError("--hf-checkpoint is required for the sglang rollout engine (an HF model folder)")
        self.nccl_port = free_port(host)  # fresh per launch: a retry after "address in use" needs new ports
        values: dict[str, Any] = {
            "model_path": str(checkpoint),
            "host": host,
            "port": port,
            "nccl_port": self.nccl_port,
            "tp_size": self.tp_size,
            "base_gpu_id": self.gpu_ids[0] if self.gpu_ids else 0,
            "gpu_id_step": 1,
            "random_seed": args.seed + self.rank,
            "enable_memory_saver": args.offload_rollout,
            "skip_server_warmup": True,
            "trust_remote_code": True,
        }
        if args.lora_rank > 0:  # adapters are loaded after start: SGLang needs the largest rank and the modules
            values.update(enable_lora=True, max_lora_rank=args.lora_rank,
                          lora_target_modules=engine_target_modules(args.target_modules, args.exclude_modules))
            if engine_keeps_base_on_host(args):  # released weights come back from host memory, not uninitialised
                values["enable_weights_cpu_backup"] = True
        if args.engine_api_key:  # SGLang takes it on its command line only; the engine's log shows `--api-key ***`
            values["api_key"] = args.engine_api_key
        if self.nnodes > 1:
            values.update(dist_init_addr=self.get_dist_init_addr(), nnodes=self.nnodes, node_rank=self.node_rank)
            if self.node_rank == 0:
                logger.info("engine %d spans %d nodes: its servers on node ranks 1..%d must be started with "
                            "dist_init_addr=%s, or this one waits for them", self.rank, self.nnodes,
                            self.nnodes - 1, values["dist_init_addr"])
        return values

    def launch_command(self, host: str, port: int) -> list[str]:
        launcher = self.launcher_command()
        forwarded = self.args.sglang_args
        fields = server_fields() if self.uses_default_launcher() else None
        if fields is not None:
            # The driver may not have had sglang to check these (or another release of it); the engine's node has
            # the SGLang that will run them: resolve them again against it (aliases, renamed flags) and type them.
            forwarded = convert_sglang_args(forwarded, fields)
        values = {**self.computed_args(host, port), **forwarded}
        return [*launcher, *sglang_cli_args(values, fields)]

    def launch_env(self) -> dict[str, str]:
        env = super().launch_env()
        for name, value in SERVER_ENV_DEFAULTS.items():  # one already in the environment wins
            env.setdefault(name, value)
        if self.gpu_ids:
            # Ray narrowed this actor to its own bundle's GPU; the server needs all tp_size of them.
            env.pop("CUDA_VISIBLE_DEVICES", None)
        return env

    # ---- lifecycle ----
    def init(self) -> str | None:
        """Start the server; node rank 0 waits for /health_generate and returns the URL, others return None."""
        if self.node_rank == 0:
            return super().init()
        if self.process is not None and self.process.poll() is None:
            return None
        self.port = free_port(self.host)
        self._start_process()
        deadline = time.monotonic() + FOLLOWER_SETTLE_S
        while time.monotonic() < deadline:
            rc = self.process.poll()
            if rc is not None:
                report, tail = self.failure_report(when=f"(node rank {self.node_rank}) at start-up"), self.log_tail()
                self.shutdown()
                raise RuntimeError(f"{report}\nlast lines of {self.log_path}:\n{tail}")
            time.sleep(0.2)
        return None

    def _call(self, method: str, path: str, json: dict | None = None, timeout: float | None = None):
        if self.node_rank != 0:
            return None  # node rank 0's server applies control calls to every node of the engine
        return super()._call(method, path, json, timeout)

    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict, serialized_tensors: str,
                                       weight_version: str | None = None) -> dict:
        """A push of the trainer's adapter: unload the one loaded last under this name, load the new one, restamp."""
        if self.loaded_adapter == lora_name:
            self.unload_lora_adapter(lora_name)
            self.loaded_adapter = None
        out = super().load_lora_adapter_from_tensors(lora_name, config_dict, serialized_tensors, weight_version)
        self.loaded_adapter = lora_name
        if weight_version is not None:
            self._call("POST", "/update_weight_version", {"new_version": str(weight_version),
                                                          "abort_all_requests": False})
        return out

    def wait_idle(self, timeout: float | None = None) -> None:
        if self.node_rank != 0:
            return  # node rank 0's scheduler answers for the engine (its /flush_cache waits for every node)
        super().wait_idle(timeout)

    def health_generate(self, timeout: float) -> bool:
        if self.node_rank != 0:
            return self.process is not None and self.process.poll() is None
        return super().health_generate(timeout)
