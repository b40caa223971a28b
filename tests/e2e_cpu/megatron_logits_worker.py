"""Megatron logits of one tiny model family after loading its HF weights (one process).

Without CUDA it installs the test-only CPU shim (fp32); on a GPU megatron-core runs for real (nccl) in
the given precision. Writes <out>/logits.pt: the input ids, the Megatron logits over the real vocabulary
and the HF model folder; the caller computes the HF logits in a process of its own (a transformers model
run in a process where the CPU shim is installed computes wrong values) and compares.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()

from tests.conftest import model_args  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--extra", default="", help="more slime flags, space-separated (e.g. --moe-router-dtype fp32)")
    cli = p.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    import torch.distributed as dist

    from slime.backends.megatron_utils import weights
    from slime.backends.megatron_utils.model import build_model, initialize_parallel
    from slime.config.arguments import parse_args
    from tools.make_tiny_model import make_tiny_model

    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cli.port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    model_dir = make_tiny_model(os.path.join(cli.out, f"tiny-{cli.arch}"), arch=cli.arch, size="tiny", seed=0)
    data = os.path.join(cli.out, "prompts.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "1+1?", "label": "2"}\n')
    argv = [*model_args(f"tiny-{cli.arch.replace('_', '-')}"), "--train-backend", "megatron",
            "--hf-checkpoint", model_dir, "--prompt-data", data, "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "1", "--global-batch-size", "1", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    if cli.dtype == "bfloat16":
        argv.append("--bf16")
    argv += cli.extra.split()
    args = parse_args(argv)
    if cli.dtype == "float32":
        args.bf16 = False  # on a GPU the megatron backend trains in bf16 unless --fp16 (slime's rule): not here
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab_size, (4, 24), generator=gen).to(device)

    initialize_parallel(args)
    model = build_model(args, wrap=False)
    weights.load_hf_weights(model, args, model_dir)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        ours = model[0](ids, positions, None)[..., : args.vocab_size].float()
    torch.save({"ids": ids.cpu(), "logits": ours.cpu(), "model_dir": model_dir}, os.path.join(cli.out, "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
