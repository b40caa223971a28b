"""Colocated weight push: a trainer's bf16 weights handed to an `hf` engine on the same GPU over CUDA IPC.

    python benchmarks/weight_sync.py [--shapes qwen3-0.6b,qwen3-4b] [--bucket-mb 512] [--repeats 3]

For each model shape (random init, published Qwen3 dimensions) the script writes an HF folder, starts the
built-in engine server on it (bf16, CUDA) and then times what a training rank does at every weight push:
split the parameters into buckets of `--bucket-mb`, flatten each into one buffer, hand the engine a CUDA
IPC handle (`update_weights_from_tensor`, SGLang's flattened_bucket payload) and wait until it has copied
the bucket into its model. It prints seconds per push (best and mean of `--repeats`, after one warm-up
push) and GB/s, and checks that the engine reports the pushed version. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.backends.hf_engine.engine import HFEngine  # noqa: E402
from slime.weight_sync.buckets import buckets  # noqa: E402
from slime.weight_sync.push import send_bucket  # noqa: E402
from tests.args import make_args  # noqa: E402

# published Qwen3 dimensions (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B)
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}


def make_model_dir(name: str, root: str, layers: int | None = None) -> tuple[str, torch.nn.Module]:
    """A random-init bf16 HF folder of the shape `name` (`layers`: fewer decoder layers than it has)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(SHAPES[name], **({"num_hidden_layers": layers} if layers else {}))
    config = Qwen3Config(**shape, max_position_embeddings=4096, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    _write_tokenizer(path, config.vocab_size)
    return path, model


def _write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over the model's vocabulary (the engine needs one; the push does not use it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="w0").save_pretrained(path)


def bench(name: str, bucket_bytes: int, repeats: int, root: str) -> dict:
    path, model = make_model_dir(name, root)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    engine = HFEngine(make_args(hf_checkpoint=path, rollout_seed=0, sglang_server_concurrency=8), rank=0)
    try:
        engine.init()
        bucket_list = list(buckets(named, bucket_bytes))
        times = []
        for i in range(repeats + 1):  # the first push warms up the engine's copy kernels
            torch.cuda.synchronize()
            start = time.perf_counter()
            for bucket in bucket_list:
                send_bucket(bucket, [engine], str(i + 1))
            times.append(time.perf_counter() - start)
        assert engine.get_weight_version() == str(repeats + 1)
    finally:
        engine.shutdown()
    del model, named
    torch.cuda.empty_cache()
    timed = times[1:]
    return {"shape": name, "params_b": nbytes / 2 / 1e9, "gbytes": nbytes / 1e9, "buckets": len(buckets),
            "best_s": min(timed), "mean_s": sum(timed) / len(timed), "gb_per_s": nbytes / 1e9 / min(timed)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/weight_sync.py needs CUDA (the colocated push hands over CUDA IPC handles)")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.shapes.split(","):
            rows.append(bench(name, args.bucket_mb << 20, args.repeats, root))
    print(f"\ncolocated CUDA-IPC push to an hf engine on the same GPU ({torch.cuda.get_device_name()}), "
          f"buckets of {args.bucket_mb} MB, best / mean of {args.repeats}")
    print("| shape | params | bf16 GB | buckets | best s | mean s | GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['params_b']:.2f} B | {r['gbytes']:.2f} | {r['buckets']} | {r['best_s']:.3f} | "
              f"{r['mean_s']:.3f} | {r['gb_per_s']:.1f} |")


if __name__ == "__main__":
    main()
