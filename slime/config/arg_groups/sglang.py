"""SGLang and sglang-router: slime's own `--sglang-*` flags, `--router-policy`, and checks on forwarded flags.

Every other `--sglang-<field>` flag is collected by slime/config/arguments.py into `args.sglang_args`
(ServerArgs field -> raw value) and every other `--router-<field>` into `args.router_args`. Here we refuse
the fields slime sets itself and, when slime will launch SGLang servers (`--rollout-backend sglang` with
CUDA, no external engines, not `--debug-train-only`) and sglang is importable, resolve every forwarded flag
through the installed SGLang's own flags (aliases and deprecated flags to the field they set, renamed flags to
the name it knows) and type its value (slime/backends/sglang_utils/arguments.py); a CPU dry run planning a GPU
run only warns about the ones it refuses (its SGLang need not be the engines'). Without sglang the values stay
strings and the SGLang engine refuses to launch, naming the package to install.
For the `hf` backend the forwarded fields are not used and stay as given.
"""

from __future__ import annotations

import argparse
import logging
import secrets

from slime.backends.sglang_utils import arguments as sglang_arguments
from slime.config.arg_groups._common import fail
from slime.utils.backend_specs import engine_spec

# ServerArgs fields slime computes per engine; forwarding them would fight slime's own choice.
RESERVED_SGLANG_FIELDS = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "random_seed": "--seed (each engine uses seed + its rank)",
    "enable_memory_saver": "--offload-rollout",
    "port": None,
    "nccl_port": None,
    "dist_init_addr": None,
    "node_rank": None,
    "nnodes": None,
    "base_gpu_id": None,
    "gpu_id_step": None,
    "skip_server_warmup": None,
    "trust_remote_code": None,
    "api_key": "--engine-api-key",
}
# sglang-router fields slime sets itself (forwarded as --router-<field>).
RESERVED_ROUTER_FIELDS = {"api_key": "--engine-api-key"}
ENGINE_API_KEY_AUTO = "auto"

logger = logging.getLogger(__name__)


def add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sglang",
        "slime's own SGLang/router flags. Any other --sglang-<field> is forwarded to every SGLang server "
        "(ServerArgs field <field>, e.g. --sglang-mem-fraction-static 0.7) and any other --router-<field> "
        "to sglang-router.",
    )
    g.add_argument(
        "--sglang-server-concurrency",
        type=int,
        default=512,
        help="Requests in flight per engine (the rollout semaphore is this × the number of engines).",
    )
    g.add_argument(
        "--sglang-router-ip", type=str, default=None, help="Use a running router at this IP instead of starting one."
    )
    g.add_argument("--sglang-router-port", type=int, default=None, help="Port of that router (or of ours).")
    g.add_argument(
        "--sglang-router-request-timeout-secs",
        type=int,
        default=14400,
        help="Seconds the router waits for an engine's answer to a request.",
    )
    g.add_argument(
        "--router-policy",
        type=str,
        default="round_robin",
        help="sglang-router load-balancing policy (round_robin, cache_aware, random, power_of_two, ...).",
    )
    g.add_argument(
        "--engine-api-key",
        type=str,
        default=None,
        help="Bearer token the engines and the router require (SGLang's and sglang-router's --api-key): every "
        "endpoint but /health* and /metrics* answers 401 without 'Authorization: Bearer <key>'. 'auto': a random "
        "key per job. Unset: no authentication. Plugins read the key as args.engine_api_key; "
        "slime.utils.http_utils post/get send it to the job's engines and router by themselves.",
    )


def validate_sglang(args: argparse.Namespace) -> None:
    if args.sglang_server_concurrency <= 0:
        fail(f"--sglang-server-concurrency {args.sglang_server_concurrency}: must be >= 1.")
    if args.sglang_router_port is not None and not 0 < args.sglang_router_port < 65536:
        fail(f"--sglang-router-port {args.sglang_router_port}: not a TCP port (1-65535).")
    if args.sglang_router_ip and args.sglang_router_port is None:
        fail(f"--sglang-router-ip {args.sglang_router_ip} names an external router but --sglang-router-port is not "
             "set; pass both, or neither to let slime start a router.")
    if args.sglang_router_request_timeout_secs <= 0:
        fail(f"--sglang-router-request-timeout-secs {args.sglang_router_request_timeout_secs}: must be > 0.")
    for name in sorted(args.sglang_args):
        _refuse_reserved(name, name)
    for name in sorted(args.router_args):
        if name in RESERVED_ROUTER_FIELDS:
            fail(f"--router-{name.replace('_', '-')}: slime sets this sglang-router setting itself; use "
                 f"{RESERVED_ROUTER_FIELDS[name]} instead.")
    _resolve_engine_api_key(args)
    if args.sglang_args and _launches_sglang(args):
        _type_forwarded_fields(args)


def _resolve_engine_api_key(args: argparse.Namespace) -> None:
    """`--engine-api-key auto` becomes a random key for this job (64 hex characters), resolved once here so
    every process of the job gets the same one in its args; only its first characters are ever logged. A key
    travels on the router's and SGLang's command lines as `--api-key KEY`, where one starting with '-' would be
    read as a flag: refused (and never drawn)."""
    key = args.engine_api_key
    if key is None:
        return
    if not key.strip() or key != key.strip() or any(c.isspace() for c in key):
        fail(f"--engine-api-key {key!r}: a key must be non-empty and hold no whitespace (it travels in an HTTP "
             "header); pass another key, 'auto' for a random one, or drop the flag for no authentication.")
    if key.startswith("-"):
        fail(f"--engine-api-key {key[:4]}...: a key starting with '-' would be read as a flag on the router's and "
             "SGLang's command lines (`--api-key KEY`); pass one that starts with a letter or digit, or 'auto'.")
    if key == ENGINE_API_KEY_AUTO:
        args.engine_api_key = secrets.token_hex(32)
        logger.info("--engine-api-key auto: generated this job's engine key (%s...); plugins read it as "
                    "args.engine_api_key", args.engine_api_key[:4])


def _refuse_reserved(flag_name: str, field: str) -> None:
    """`--sglang-<flag_name>` (which sets ServerArgs.<field>) is refused when slime computes that field."""
    if field in RESERVED_SGLANG_FIELDS:
        instead = RESERVED_SGLANG_FIELDS[field]
        fix = f"use {instead} instead" if instead else "slime sets it for each engine; drop the flag"
        sets = f" (it sets SGLang's {field})" if field != flag_name else ""
        fail(f"--sglang-{flag_name.replace('_', '-')}{sets}: slime computes this SGLang setting itself; {fix}.")


def _launches_sglang(args: argparse.Namespace) -> bool:
    return engine_spec(args).takes_sglang_server_args and bool(args.use_cuda) and not args.debug_train_only


def _type_forwarded_fields(args: argparse.Namespace) -> None:
    """Resolve the forwarded flags against the installed SGLang (aliases to their fields) and type them.

    A dry run planning a GPU run on a machine without CUDA (`--dry-run-cuda`, e.g. a login node) only warns:
    the SGLang installed there need not be the release the GPU nodes run, and the engines check the flags
    against theirs when they launch. Everywhere else (the driver of a run, a dry run on a GPU node) a flag the
    installed SGLang refuses is an error here, before anything starts."""
    fields = sglang_arguments.server_fields()  # imports sglang (seconds): only done when SGLang servers will be launched
    if fields is None:
        return
    typed, problems = sglang_arguments.check_sglang_args(args.sglang_args, fields)
    for name in args.sglang_args:
        if name in fields:
            _refuse_reserved(name, fields[name].name)
    if problems and not args.dry_run_cuda:
        fail(f"{problems[0]}.")
    for problem in problems:
        logger.warning("%s. Not refused by a dry run away from the GPUs: this machine's SGLang (%s) need not be "
                       "the engines'; they check the flag against theirs when they launch.", problem,
                       sglang_arguments.sglang_version())
    args.sglang_args = typed
