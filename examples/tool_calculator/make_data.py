"""Write the calculator tool-use task as JSONL: "what is A plus B? call the tool or answer." with label A+B.

A + B stays within 0..9 so that every answer is one word of the tiny model's vocabulary (its tokenizer
splits numbers into single digits); the sum is drawn uniformly first, then A, so that answering one fixed
number earns only ~10%. Deterministic from --seed.

    python examples/tool_calculator/make_data.py --out data/calc_train.jsonl --num-samples 20000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

TEMPLATES = [
    "what is {a} plus {b}? call the tool or answer.",
    "what is {a} + {b}? call the tool or answer.",
]


def make_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        total = rng.randrange(0, 10)
        a = rng.randrange(0, total + 1)
        rows.append({"prompt": rng.choice(TEMPLATES).format(a=a, b=total - a), "label": str(total)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-samples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_rows(args.num_samples, args.seed))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
