"""Args for tests, built by slime's real parser and validation (no hand-made partial namespaces).

    make_args()                                       # a valid train-only command line, every default resolved
    make_args("--advantage-estimator", "ppo")         # flags as on the command line
    make_args(hf_checkpoint=path, debug_train_only=False, rollout_num_gpus=1)   # fields set before validation
    make_args(validate=False, eps_clip=0.1)           # the parser's defaults only (derived fields left unset)
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from slime.config.arguments import build_parser, split_argv, validate_args

# The smallest command line that validates without files: training only (no engines), 2 prompts x 2 samples.
BASELINE = ("--debug-train-only", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size",
            "4", "--actor-num-gpus-per-node", "1", "--num-rollout", "1")


def make_args(*argv: str, validate: bool = True, **fields) -> argparse.Namespace:
    """BASELINE then `argv` parsed as train.py parses them, `fields` set by name (a name the parser does not
    define is an error), then validated unless `validate=False`."""
    parser = build_parser()
    split = split_argv(parser, [*BASELINE, *argv])
    if split.unknown:
        raise ValueError(f"make_args: unknown flag(s) {split.unknown}")
    args = parser.parse_args(split.known)
    args.sglang_args, args.router_args, args.megatron_args = split.sglang_args, split.router_args, split.megatron_args
    for name, value in fields.items():
        if not hasattr(args, name):
            raise AttributeError(f"make_args: {name!r} is not a field of slime's args (a flag's dest or a derived "
                                 "field of slime.config.arguments.DERIVED_FIELDS)")
        setattr(args, name, value)
    return validate_args(args, parser) if validate else args


def router_fields(url: str) -> dict:
    """`--sglang-router-ip/--sglang-router-port` of a router (or router-shaped test peer) at `url`."""
    parts = urlsplit(url)
    return {"sglang_router_ip": parts.hostname, "sglang_router_port": parts.port}
