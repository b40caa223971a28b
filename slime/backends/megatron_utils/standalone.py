"""Running the Megatron model outside `train.py` (the checkpoint conversion tools).

`parse_model_flags(argv, tool_parser)` reads the tool's own flags with `tool_parser` and everything else
as slime flags (MODEL_ARGS, parallel sizes, `--hf-checkpoint`, ...), validated like `train.py` validates
the Megatron family. `init_distributed()` joins the process group torchrun describes (WORLD_SIZE, RANK,
MASTER_ADDR/PORT in the environment), or a one-process group when run as plain `python`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from slime.utils.arguments import build_parser, check_model_args, check_unknown_flags, split_argv
from slime.utils.arg_groups.megatron import validate_megatron


def parse_model_flags(
    argv: list[str], tool_parser: argparse.ArgumentParser
) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(tool flags, slime flags) from one command line."""
    tool, rest = tool_parser.parse_known_args(argv)
    parser = build_parser()
    split = split_argv(parser, rest)
    check_unknown_flags(parser, split.unknown)
    args = parser.parse_args(split.known)
    args.megatron_args = split.megatron_args
    args.train_backend = "megatron"
    args.use_cuda = torch.cuda.is_available()
    validate_megatron(args)
    check_model_args(args)
    return tool, args


def init_distributed() -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))
