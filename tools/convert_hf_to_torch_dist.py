"""HF checkpoint -> Megatron torch_dist checkpoint (a "release" starting point for `--load` / `--ref-load`).

    source scripts/models/qwen3-4B.sh
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B \
        --save /root/Qwen3-4B_torch_dist
    # large models: torchrun --nproc-per-node 8 tools/convert_hf_to_torch_dist.py ... --tensor-model-parallel-size 8

MODEL_ARGS are checked against the checkpoint's config.json first. The output folder holds
`latest_checkpointed_iteration.txt` ("release") and `release/`; dist_checkpointing re-shards on load, so
it loads at any TP / PP / EP layout. Needs CUDA, like the Megatron backend.
"""

from __future__ import annotations

import argparse
import os
import sys

from slime.backends.megatron_utils import args as mg_args
from slime.backends.megatron_utils import checkpoint, weights
from slime.backends.megatron_utils.model import build_model, initialize_parallel
from slime.backends.megatron_utils.standalone import init_distributed
from slime.config.arguments import parse_model_flags
from slime.utils.errors import SlimeArgumentError


def main(argv: list[str] | None = None) -> None:
    tool_parser = argparse.ArgumentParser(add_help=False)
    try:
        _, args = parse_model_flags(sys.argv[1:] if argv is None else argv, tool_parser)
        if not args.hf_checkpoint or not args.save:
            raise SlimeArgumentError("give --hf-checkpoint (the HF model folder) and --save (the output folder)")
        mg_args.check_megatron_runtime(args)
    except SlimeArgumentError as e:
        sys.exit(f"error: {e}")
    init_distributed()
    initialize_parallel(args)
    model = build_model(args, wrap=False)
    weights.load_hf_weights(model, args, args.hf_checkpoint)
    path = checkpoint.save(args.save, None, model, state={"megatron_args": args.megatron_args,
                                                          "hf_checkpoint": os.path.abspath(args.hf_checkpoint)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
