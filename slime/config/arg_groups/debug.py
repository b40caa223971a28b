"""Debug: run only one half of the loop, dump or replay rollout data, check weight pushes, dry-run plans.

`validate_debug` runs first of all validators (arg_groups.VALIDATE_ORDER), so `--dry-run-cuda` can make
every later check and default see a GPU machine.
"""

from __future__ import annotations

import argparse
import logging

from slime.config.arg_groups._common import fail

logger = logging.getLogger(__name__)


def add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug", "Half-loop runs and rollout dumps.")
    g.add_argument("--debug-rollout-only", action="store_true", help="Generate only; no training ranks.")
    g.add_argument("--debug-train-only", action="store_true", help="Train only; no engines (needs rollout data).")
    g.add_argument(
        "--save-debug-rollout-data",
        type=str,
        default=None,
        help="Save each rollout's data to this path; put {rollout_id} in it, e.g. /tmp/rollout_{rollout_id}.pt. "
        "Each eval's samples go to the same path with {rollout_id} as eval_<id>.",
    )
    g.add_argument(
        "--load-debug-rollout-data",
        type=str,
        default=None,
        help="Train on rollout data saved by --save-debug-rollout-data (same {rollout_id} path); implies "
        "--debug-train-only.",
    )
    g.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        help="With --load-debug-rollout-data: train on int(N x this ratio) of each rollout's N saved samples, half "
        "from the start of the file and half from its end, for faster debugging (0 < ratio <= 1); the rollouts "
        "past the last whole --global-batch-size step are dropped.",
    )
    g.add_argument(
        "--save-debug-train-data",
        type=str,
        default=None,
        help="Save what each rollout's training read (per-sample tensors and the step / micro-batch layout, "
        "slime's format 2; docs/training_loop.md) to this path; put {rollout_id} (and optionally {rank}) in it.",
    )
    g.add_argument(
        "--dump-details",
        type=str,
        default=None,
        help="Folder for a full dump for post-hoc analysis, as slime's: DIR/rollout_data/{rollout_id}.pt (unless "
        "--save-debug-rollout-data), DIR/train_data/{rollout_id}.pt (unless --save-debug-train-data), DIR/tokenizer.",
    )
    g.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="As slime's: once the engines are up, snapshot their weights and overwrite them with random values; "
        "after the first push, fail unless every engine tensor equals its snapshot again, naming each one that "
        "differs (POST /weights_checker; checks that the push covers every weight and converts it losslessly).",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate the arguments, print the plan (placement, batch math, memory estimates, warnings) and "
        "exit 0 without starting Ray or any process (docs/dry_run.md).",
    )
    g.add_argument(
        "--dry-run-gpu-gb",
        type=float,
        default=None,
        help="GPU memory per device (GB) that the --dry-run memory estimates are checked against (default 80).",
    )
    g.add_argument(
        "--dry-run-cuda",
        action="store_true",
        help="With --dry-run on a machine without CUDA (e.g. a login node): plan the run as a GPU run, with the "
        "defaults and checks that depend on CUDA (megatron / sglang backends, nccl, GPU bundles).",
    )
    g.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="Start (or, with --dry-run, pass) a colocated run that the plan's memory estimate refuses: engines and "
        "training both resident on a GPU that their estimated sum overfills (--no-offload-rollout / "
        "--no-offload-train; docs/dry_run.md). The estimate is rough; this flag is for when it is wrong.",
    )


def validate_debug(args: argparse.Namespace) -> None:
    validate_dry_run(args)
    if args.load_debug_rollout_data is not None:
        if args.debug_rollout_only:
            fail("--load-debug-rollout-data (train on saved data) contradicts --debug-rollout-only; drop one.")
        args.debug_train_only = True
    ratio = args.load_debug_rollout_data_subsample
    if ratio is not None:
        if args.load_debug_rollout_data is None:
            fail(f"--load-debug-rollout-data-subsample {ratio} subsamples the data --load-debug-rollout-data loads; "
                 "add --load-debug-rollout-data or drop the ratio.")
        if not 0 < ratio <= 1:
            fail(f"--load-debug-rollout-data-subsample {ratio}: the part of each saved rollout to train on must be in "
                 "(0, 1], e.g. 0.5.")
    if args.debug_rollout_only and args.debug_train_only:
        fail("--debug-rollout-only and --debug-train-only are both set; choose one half of the loop.")
    if args.check_weight_update_equal and args.debug_rollout_only:
        fail("--check-weight-update-equal overwrites the engines' weights until the trainer's first push restores "
             "them, but --debug-rollout-only runs no trainer (the rollout would sample from random weights); "
             "drop one of them.")
    if args.check_weight_update_equal and args.debug_train_only:
        logger.warning("--check-weight-update-equal with --debug-train-only: there are no engines, nothing is checked.")
    if args.dump_details is not None:
        if args.save_debug_rollout_data is None:
            args.save_debug_rollout_data = f"{args.dump_details}/rollout_data/{{rollout_id}}.pt"
        if args.save_debug_train_data is None:
            args.save_debug_train_data = f"{args.dump_details}/train_data/{{rollout_id}}.pt"
    if args.save_debug_train_data is not None and args.save_debug_train_data == args.save_debug_rollout_data:
        fail(f"--save-debug-train-data must not be equal to --save-debug-rollout-data ({args.save_debug_train_data}): "
             "the two dumps would overwrite each other; give each its own path.")
    for dest in ("save_debug_rollout_data", "load_debug_rollout_data", "save_debug_train_data"):
        path = getattr(args, dest)
        if path is not None and "{rollout_id}" not in path:
            logger.warning(
                "--%s %s has no {rollout_id}: every rollout uses the same file.", dest.replace("_", "-"), path
            )


def validate_dry_run(args: argparse.Namespace) -> None:
    gpu_gb, cuda = args.dry_run_gpu_gb, args.dry_run_cuda
    if not args.dry_run:
        if gpu_gb is not None or cuda:
            given = "--dry-run-gpu-gb" if gpu_gb is not None else "--dry-run-cuda"
            fail(f"{given} only applies to a dry run; add --dry-run or drop {given}.")
        return
    if gpu_gb is not None and not gpu_gb > 0:
        fail(f"--dry-run-gpu-gb {gpu_gb}: must be a positive number of GB, e.g. 80.")
    if args.use_cuda:
        args.dry_run_cuda = False  # CUDA is here anyway: nothing to pretend
        return
    gpu_pieces = gpu_only_pieces(args)
    if not cuda and gpu_pieces and not cpu_only_pieces(args):
        logger.info("--dry-run on a machine without CUDA: planning the GPU run this command line describes (%s); "
                    "add --rollout-backend hf to plan a CPU run instead.", ", ".join(gpu_pieces))
        cuda = args.dry_run_cuda = True
    args.use_cuda = bool(cuda)


def gpu_only_pieces(args: argparse.Namespace) -> list[str]:
    """Flags of the command line that only a GPU machine runs: a dry run plans for one when it names them."""
    pieces = [f"--{flag} {value}" for flag, value in (("rollout-backend", args.rollout_backend),
                                                       ("train-backend", args.train_backend),
                                                       ("distributed-backend", args.distributed_backend))
              if value in ("sglang", "megatron", "nccl")]  # fmt: skip
    if args.sglang_args:
        pieces.append("--sglang-" + next(iter(args.sglang_args)).replace("_", "-") + " (SGLang engines)")
    return pieces


def cpu_only_pieces(args: argparse.Namespace) -> list[str]:
    return [f"--{flag} {value}" for flag, value in (("rollout-backend", args.rollout_backend),
                                                     ("distributed-backend", args.distributed_backend))
            if value in ("hf", "gloo")]  # fmt: skip
