"""slime's weight-sync modes: delta updates (built), released training actors and NIXL (refused).

The transports (`--update-weight-transport nccl|disk`, `--update-weight-disk-dir`, ...) live with the rollout
flags (slime/config/arg_groups/rollout.py). `--update-weight-mode delta` (ship only the tensors that changed,
through disk: slime/weight_sync/delta.py) and its flags are here; `--release-train` (recreate the training actors
each step) and `--rollout-data-transport nixl` parse with slime's defaults. Validation first applies slime's
couplings (with slime's wording, so a misconfigured command line reads the same error), then refuses what is not
built here, naming what to use instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

from slime.config.arg_groups._common import fail, refuse

logger = logging.getLogger(__name__)

_DELTA_ONLY = {"update_weight_delta_encoding": "xor", "update_weight_delta_checksum": "xxh3-128"}


def add_weight_update_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weight sync modes", "slime's delta weight sync (built); released training "
                                  "actors and NIXL rollout data: parsed, refused when used (not built here).")  # fmt: skip
    g.add_argument("--update-weight-mode", choices=["full", "delta"], default="full",
                   help="full: every parameter at every push. delta: the first push is a full checkpoint, every "
                   "later one only the tensors that changed since the previous push (needs --update-weight-transport "
                   "disk and --update-weight-local-checkpoint-dir; not with --colocate).")
    g.add_argument("--update-weight-delta-encoding", choices=["xor", "overwrite"], default="xor",
                   help="How --update-weight-mode delta writes a changed tensor: xor (new bytes XOR the previous "
                   "ones; applied exactly once on the right base) or overwrite (the changed byte positions and their "
                   "new bytes; smaller when few bytes changed, re-applicable). Byte-level: any dtype.")
    g.add_argument("--update-weight-delta-checksum", choices=["xxh3-128", "blake3", "adler32"], default="xxh3-128",
                   help="Checksum of every pushed tensor's new bytes in --update-weight-mode delta; the engine "
                   "checks all before replacing any file (blake3 needs the blake3 package).")
    g.add_argument("--update-weight-local-checkpoint-dir", type=str, default=None,
                   help="Folder on each engine's host holding the full checkpoint that --update-weight-mode delta "
                   "keeps up to date (the first push is copied there, later deltas applied) and the engines load "
                   "from; required by delta mode.")
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
    if delta and args.update_weight_delta_checksum == "blake3" and importlib.util.find_spec("blake3") is None:
        fail("--update-weight-delta-checksum blake3 needs the Python package 'blake3', which is not installed: "
             "pip install blake3, or choose xxh3-128 (the default) or adler32.")
    if not delta:
        for dest, default in _DELTA_ONLY.items():
            if getattr(args, dest) != default:
                logger.warning("--%s applies to --update-weight-mode delta only; it has no effect here.",
                               dest.replace("_", "-"))
    if args.update_weight_local_checkpoint_dir and not delta:
        logger.warning("--update-weight-local-checkpoint-dir %s: only --update-weight-mode delta uses it; with full "
                       "pushes the engines read --update-weight-disk-dir directly.",
                       args.update_weight_local_checkpoint_dir)
    if args.rollout_data_transport == "nixl":
        refuse("rollout_data_transport", "nixl", "rollout data reaches the trainer through Ray's object store here",
               "drop it (object-store is the default)")
