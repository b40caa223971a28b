"""slime's weight-sync flags for modes not built here: delta updates, released training actors, NIXL.

The transports (`--update-weight-transport nccl|disk`, `--update-weight-disk-dir`, ...) live with the rollout
flags (slime/config/arg_groups/rollout.py): every push sends the weights in full. slime's delta mode (ship only
the bytes that changed, through disk), `--release-train` (recreate the training actors each step) and
`--rollout-data-transport nixl` parse with slime's defaults; validation first applies slime's couplings (with
slime's wording, so a misconfigured command line reads the same error), then refuses what is not built here,
naming what to use instead.
"""

from __future__ import annotations

import argparse
import logging

from slime.config.arg_groups._common import fail, refuse

logger = logging.getLogger(__name__)

_DELTA_ONLY = {"update_weight_delta_encoding": "xor", "update_weight_delta_checksum": "xxh3-128"}


def add_weight_update_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weight sync modes", "slime's delta weight sync, released training actors and "
                                  "NIXL rollout data: parsed, refused when used (not built here).")  # fmt: skip
    g.add_argument("--update-weight-mode", choices=["full", "delta"], default="full",
                   help="full: every parameter at every push. delta (slime: ship only the changed bytes through "
                   "disk): refused here.")
    g.add_argument("--update-weight-delta-encoding", choices=["xor", "overwrite"], default="xor",
                   help="slime: on-disk encoding of --update-weight-mode delta.")
    g.add_argument("--update-weight-delta-checksum", choices=["xxh3-128", "blake3", "adler32"], default="xxh3-128",
                   help="slime: per-tensor checksum of --update-weight-mode delta.")
    g.add_argument("--update-weight-local-checkpoint-dir", type=str, default=None,
                   help="slime: engine-host folder the engines pull pushed checkpoints into (needed by delta mode); "
                   "not built here: the engines read --update-weight-disk-dir directly.")
    g.add_argument("--release-train", action="store_true",
                   help="slime: release the training actors during rollout and recreate them (needs disk weight "
                   "sync and --save): refused here.")
    g.add_argument("--rollout-data-transport", type=str, choices=["object-store", "nixl"], default="object-store",
                   help="How rollout data reaches the trainer: Ray's object store (nixl, slime's Ray NIXL transfer, "
                   "is refused here).")


def validate_weight_update(args: argparse.Namespace) -> None:
    """slime's couplings first, then what is not built here."""
    disk = args.update_weight_transport == "disk"
    delta = args.update_weight_mode == "delta"
    if delta and not disk:
        fail(f"--update-weight-mode delta requires --update-weight-transport=disk (got "
             f"{args.update_weight_transport}); deltas travel as files.")
    if delta and args.colocate:
        fail("--update-weight-mode delta is not supported with --colocate (colocated engines take the weights "
             "from GPU memory); drop one of them.")
    if delta and not args.update_weight_local_checkpoint_dir:
        fail("--update-weight-mode delta requires --update-weight-local-checkpoint-dir DIR, the engine-host "
             "folder the deltas are applied to.")
    if args.release_train and not (disk and args.save):
        fail("--release-train requires --update-weight-transport disk and --save (the recreated actors reload "
             "from --save).")
    if args.release_train:
        refuse("release_train", True, "the training actors stay alive for the whole run here",
               "drop it (--colocate shares the GPUs between training and the engines)")
    if delta:
        refuse("update_weight_mode", "delta", "every push sends the weights in full here",
               "drop --update-weight-mode (full is the default)")
    for dest, default in _DELTA_ONLY.items():
        if getattr(args, dest) != default:
            logger.warning("--%s applies to --update-weight-mode delta only; it has no effect here.",
                           dest.replace("_", "-"))
    if args.update_weight_local_checkpoint_dir:
        logger.warning("--update-weight-local-checkpoint-dir %s: not acted on here: the engines read "
                       "--update-weight-disk-dir directly.", args.update_weight_local_checkpoint_dir)
    if args.rollout_data_transport == "nixl":
        refuse("rollout_data_transport", "nixl", "rollout data reaches the trainer through Ray's object store here",
               "drop it (object-store is the default)")
