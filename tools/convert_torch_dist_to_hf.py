"""Megatron torch_dist checkpoint -> HF model folder (safetensors + config and tokenizer files).

    python tools/convert_torch_dist_to_hf.py --input-dir /root/ckpt/iter_0000099 \
        --output-dir /root/Qwen3-4B-rl --origin-hf-dir /root/Qwen3-4B

`--input-dir` is one checkpoint folder or a `--save` folder (its latest checkpoint is taken). The model
architecture comes from the Megatron flags slime stored with the checkpoint; for a checkpoint without
them, pass MODEL_ARGS on the command line. Config and tokenizer files are copied from `--origin-hf-dir`,
whose config.json also picks the HF names (model family). Runs as one process, on the GPU if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from slime.backends.megatron_utils import args as mg_args
from slime.backends.megatron_utils import checkpoint, weights
from slime.backends.megatron_utils.model import build_model, initialize_parallel
from slime.backends.megatron_utils.standalone import init_distributed
from slime.config.arguments import parse_model_flags
from slime.utils.errors import SlimeArgumentError

_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    tool_parser = argparse.ArgumentParser(add_help=False)
    tool_parser.add_argument("--input-dir", required=True)
    tool_parser.add_argument("--output-dir", required=True)
    tool_parser.add_argument("--origin-hf-dir", required=True)
    try:
        tool, _ = tool_parser.parse_known_args(argv)
        ckpt = checkpoint.find_checkpoint(tool.input_dir, "--input-dir")
        if ckpt is None:
            raise SlimeArgumentError(f"--input-dir {tool.input_dir}: no torch_dist checkpoint there")
        stored = ckpt.state.get("megatron_args") or []
        _, args = parse_model_flags(stored + argv + ["--hf-checkpoint", tool.origin_hf_dir], tool_parser)
        mg_args.check_megatron_runtime(args)
    except SlimeArgumentError as e:
        sys.exit(f"error: {e}")
    # One process holds the whole model: the stored parallel layout does not apply here.
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = args.expert_model_parallel_size = 1
    args.expert_tensor_parallel_size = 1
    args.num_layers_per_virtual_pipeline_stage = None
    args.sequence_parallel = False
    init_distributed()
    initialize_parallel(args)
    model = build_model(args, wrap=False)
    checkpoint.load_model(ckpt, model)
    with open(os.path.join(tool.origin_hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    tensors = {name: t.detach().cpu().contiguous() for name, t in weights.iter_hf_weights(model, args, hf_config)}
    from safetensors.torch import save_file

    os.makedirs(tool.output_dir, exist_ok=True)
    save_file(tensors, os.path.join(tool.output_dir, "model.safetensors"), metadata={"format": "pt"})
    for name in _SIDE_FILES:
        src = os.path.join(tool.origin_hf_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tool.output_dir, name))
    print(f"wrote {tool.output_dir} ({len(tensors)} tensors from {ckpt.path})")


if __name__ == "__main__":
    main()
