"""slime's helpers for launcher scripts written in Python (slime's tests and e.g. examples/geo3k_vlm_multi_turn):
each builds a shell command and runs it with `exec_command` (bash, echoed first, an error when it fails).

- `execute_train(train_args, num_gpus_per_node, megatron_model_type, ...)`: unless `SLIME_SCRIPT_EXTERNAL_RAY`
  is true, `ray stop --force` and `ray start --head` on `MASTER_ADDR` (default 127.0.0.1); then
  `before_ray_job_submit()`; then (unless `SLIME_SCRIPT_ENABLE_RAY_SUBMIT` is false) `ray job submit -- python3
  train.py [${MODEL_ARGS[@]} of scripts/models/<megatron_model_type>.sh] <train_args>` with a runtime env of
  PYTHONPATH, RAY_USE_UVLOOP=0, CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL_NVLS_ENABLE (1 when `nvidia-smi topo -m`
  shows NVLink), no_proxy, MASTER_ADDR, the CUDA core-dump settings with `config.cuda_core_dump`, and the extra
  variables (`extra_env_vars`, and `config.extra_env_vars` as JSON or `A=1 B=2`).
  Simplified: slime first `pkill -9`s every sglang, ray, slime and redis process on the machine; here runs reap
  their own processes (engines, router, Ray's agents) on every exit path, so nothing is killed by name. The job's
  PYTHONPATH starts with this checkout (slime's names only /root/Megatron-LM/), so the job imports this slime and
  its `examples.*` plugins whatever the working directory.
- `convert_checkpoint(model_name, megatron_model_type, num_gpus_per_node, ...)`: tools/convert_hf_to_torch_dist.py
  under torchrun, from /root/models/<model_name> (or `hf_checkpoint`) to <dir_dst>/<model_name>_torch_dist,
  skipped when that exists; `multinode` reads SLURM_JOB_HOSTNAMES / SLURM_NODEID.
- `rsync_simple`, `hf_download_dataset` (into /root/datasets/<name>), `check_has_nvlink`,
  `get_default_wandb_args` (wandb flags when WANDB_API_KEY is set, else ""), `create_run_id`,
  `get_bool_env_var`, `get_env_enable_infinite_run`, `save_to_temp_file`, `NUM_GPUS_OF_HARDWARE`,
  `GENERATION_HARDWARE`, `repo_base_dir`, and `dataclass_cli` (typer_utils.py).
- Not supported: `fp8_cast_bf16` (this implementation has no tools/fp8_cast_bf16.py); it raises, saying so.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slime.utils.external_utils.typer_utils import dataclass_cli

__all__ = [
    "GENERATION_HARDWARE", "NUM_GPUS_OF_HARDWARE", "ExecuteTrainConfig", "check_has_nvlink", "convert_checkpoint",
    "create_run_id", "dataclass_cli", "exec_command", "execute_train", "fp8_cast_bf16", "get_bool_env_var",
    "get_default_wandb_args", "get_env_enable_infinite_run", "hf_download_dataset", "repo_base_dir",
    "rsync_simple", "save_to_temp_file",
]  # fmt: skip

repo_base_dir = Path(__file__).resolve().parents[3]

NUM_GPUS_OF_HARDWARE = {"H100": 8, "GB200": 4, "GB300": 4}
GENERATION_HARDWARE = {"H100": "Hopper", "GB200": "Blackwell", "GB300": "Blackwell"}

_CORE_DUMP_ENV = {
    "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
    "CUDA_COREDUMP_SHOW_PROGRESS": "1",
    "CUDA_COREDUMP_GENERATION_FLAGS": "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
                                      "skip_local_memory,skip_constbank_memory",
    "CUDA_COREDUMP_FILE": "/root/shared_data/cuda_coredump_%h.%p.%t",
}  # fmt: skip


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """Run `cmd` with bash after printing it; a non-zero exit raises CalledProcessError. With `capture_output`,
    returns its stdout (and prints what it captured)."""
    print(f"EXEC: {cmd}", flush=True)
    try:
        result = subprocess.run(["bash", "-c", cmd], check=True, capture_output=capture_output,
                                text=capture_output or None)  # fmt: skip
    except subprocess.CalledProcessError as e:
        if capture_output:
            print(f"stdout={e.stdout!r} stderr={e.stderr!r}")
        raise
    if capture_output:
        print(f"captured stdout={result.stdout!r} stderr={result.stderr!r}")
        return result.stdout
    return None


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """True for "true" / "1" (any case), False for "false" / "0"; anything else is False, with a note once."""
    value = os.environ.get(name, default).lower()
    if value not in ("true", "1", "false", "0") and value not in _UNCLEAR_BOOL_VALUES:
        _UNCLEAR_BOOL_VALUES.add(value)
        print(f"get_bool_env_var({name}): {value!r} is neither true/1 nor false/0; taken as false")
    return value in ("true", "1")


_UNCLEAR_BOOL_VALUES: set[str] = set()


def get_env_enable_infinite_run() -> bool:
    return get_bool_env_var("SLIME_TEST_ENABLE_INFINITE_RUN", "false")


def create_run_id() -> str:
    """UTC `yymmdd-HHMMSS-NNN` (NNN random)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%y%m%d-%H%M%S")
    return f"{stamp}-{random.Random().randint(0, 999):03d}"


def save_to_temp_file(text: str, ext: str) -> str:
    path = Path(f"/tmp/slime_temp_file_{time.time()}_{random.randrange(0, 10_000_000)}.{ext}")
    path.write_text(text)
    print(f"wrote {path}: {text!r}")
    return str(path)


def check_has_nvlink() -> bool:
    """Whether `nvidia-smi topo -m` shows an NVLink (NV<n>) connection; False without nvidia-smi."""
    output = exec_command("nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l", capture_output=True)
    return int(output) > 0


def get_default_wandb_args(test_file: str, run_name_prefix: str | None = None, run_id: str | None = None) -> str:
    """wandb flags for a test script (project slime-<test name>, group <run id>[_<GITHUB_COMMIT_NAME>], with
    `run_name_prefix` in front); "" without WANDB_API_KEY."""
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        print("WANDB_API_KEY is not set: no wandb flags")
        return ""
    path = Path(test_file)
    test_name = path.stem if len(path.stem) >= 6 else f"{path.parent.name}_{path.stem}"
    group = run_id or create_run_id()
    if os.environ.get("GITHUB_COMMIT_NAME") is not None:
        group += f"_{os.environ['GITHUB_COMMIT_NAME']}"
    if run_name_prefix is not None:
        group = f"{run_name_prefix}_{group}"
    return (f"--use-wandb --wandb-project slime-{test_name} --wandb-group {group} --wandb-key '{key}' "
            "--disable-wandb-random-suffix ")  # fmt: skip


def convert_checkpoint(model_name: str, megatron_model_type: str, num_gpus_per_node: int, multinode: bool = False,
                       extra_args: str = "", dir_dst: str = "/root", hf_checkpoint: str | None = None) -> None:  # fmt: skip
    hf_checkpoint = hf_checkpoint or f"/root/models/{model_name}"
    path_dst = f"{dir_dst}/{model_name}_torch_dist"
    if Path(path_dst).exists():
        print(f"convert_checkpoint: {path_dst} exists, skipped")
        return
    nodes = ""
    if multinode:  # e.g. export SLURM_JOB_HOSTNAMES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
        hosts = os.environ["SLURM_JOB_HOSTNAMES"].strip().split("\n")
        nodes = (f"--master-addr {hosts[0]} --master-port 23456 --nnodes={len(hosts)} "
                 f"--node-rank {int(os.environ['SLURM_NODEID'])} ")  # fmt: skip
    extra = f" {extra_args.strip()}" if extra_args.strip() else ""
    exec_command(
        f"source {repo_base_dir}/scripts/models/{megatron_model_type}.sh && "
        f"PYTHONPATH={repo_base_dir}:/root/Megatron-LM:${{PYTHONPATH:-}} "
        f"torchrun --nproc-per-node {num_gpus_per_node} {nodes}{repo_base_dir}/tools/convert_hf_to_torch_dist.py "
        f"${{MODEL_ARGS[@]}} --hf-checkpoint {hf_checkpoint} --save {path_dst}{extra}"
    )


def rsync_simple(path_src: str, path_dst: str) -> None:
    exec_command(f"mkdir -p {path_dst} && rsync -a --info=progress2 {path_src}/ {path_dst}")


def hf_download_dataset(full_name: str) -> None:
    _, name = full_name.split("/")
    exec_command(f"hf download --repo-type dataset {full_name} --local-dir /root/datasets/{name}")


def fp8_cast_bf16(path_src: str, path_dst: str) -> None:
    raise NotImplementedError(
        f"fp8_cast_bf16({path_src!r}, {path_dst!r}): this implementation has no tools/fp8_cast_bf16.py (slime's FP8 "
        "-> BF16 checkpoint cast); cast the checkpoint with slime's tool, or start from a BF16 checkpoint"
    )


@dataclass
class ExecuteTrainConfig:
    """What a launcher script may set on `execute_train` (scripts extend it with their own fields)."""

    cuda_core_dump: bool = False
    num_nodes: int = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    extra_env_vars: str = ""


def parse_extra_env_vars(text: str) -> dict[str, str]:
    """`config.extra_env_vars`: a JSON object, or space-separated NAME=VALUE pairs."""
    try:
        return json.loads(text)
    except ValueError:
        return dict(item.split("=", 1) for item in text.split() if item)


def execute_train(train_args: str, num_gpus_per_node: int, megatron_model_type: str | None,
                  train_script: str = "train.py", before_ray_job_submit: Callable[[], None] | None = None,
                  extra_env_vars: dict[str, str] | None = None, config: ExecuteTrainConfig | None = None) -> None:  # fmt: skip
    """Start Ray and submit `train_script` with `train_args` as a Ray job (the module docstring)."""
    config = config or ExecuteTrainConfig()
    external_ray = get_bool_env_var("SLIME_SCRIPT_EXTERNAL_RAY")
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if not external_ray:
        exec_command("ray stop --force")
        exec_command(f"export PYTHONUNBUFFERED=1 && ray start --head --node-ip-address {master_addr} "
                     f"--num-gpus {num_gpus_per_node} --disable-usage-stats")  # fmt: skip
    if before_ray_job_submit is not None:
        before_ray_job_submit()
    env_vars = {
        "PYTHONPATH": f"{repo_base_dir}:/root/Megatron-LM/",
        "RAY_USE_UVLOOP": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_NVLS_ENABLE": str(int(check_has_nvlink())),
        "no_proxy": f"127.0.0.1,{master_addr}",
        "MASTER_ADDR": master_addr,  # torch.distributed's rendezvous across nodes
        **(_CORE_DUMP_ENV if config.cuda_core_dump else {}),
        **(extra_env_vars or {}),
        **parse_extra_env_vars(config.extra_env_vars),
    }
    if not get_bool_env_var("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        return
    model_source = (f"source {shlex.quote(f'{repo_base_dir}/scripts/models/{megatron_model_type}.sh')} && "
                    if megatron_model_type is not None else "")  # fmt: skip
    model_args = "${MODEL_ARGS[@]} " if megatron_model_type is not None else ""
    exec_command(
        f"export no_proxy=127.0.0.1 && export PYTHONUNBUFFERED=1 && {model_source}"
        f'ray job submit --address="http://127.0.0.1:8265" '
        f"--runtime-env-json={shlex.quote(json.dumps({'env_vars': env_vars}))} "
        f"-- python3 {train_script} {model_args}{train_args}"
    )
