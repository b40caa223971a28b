"""Write a teacher for the CPU on-policy distillation example: a tiny model other than the student, sharp enough
that the student-teacher KL is large at the start.

The student is tools/make_tiny_model.py's random-init model (seed 0). The teacher is the same architecture and
tokenizer with other random weights (--seed, default 1) and its output layer scaled by --sharpness (default 16):
a random-init model predicts nearly uniformly over the vocabulary (logits of std ~0.2), the scaled one puts most
of its mass on a few tokens that depend on the context, which the student then has to learn from the teacher's
log-probs of its own samples.

    python examples/on_policy_distillation/make_teacher.py --out models/tiny-qwen3-teacher
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.make_tiny_model import make_tiny_model  # noqa: E402


def make_teacher(out: str, seed: int = 1, sharpness: float = 16.0) -> str:
    from transformers import AutoModelForCausalLM

    make_tiny_model(out, size="tiny", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sharpness", type=float, default=16.0)
    args = parser.parse_args()
    print(f"wrote {make_teacher(args.out, args.seed, args.sharpness)}")


if __name__ == "__main__":
    main()
