"""Write the calculator tool-use task as JSONL: the user asks for the sum of two secret numbers that only the
calculator can see.

    {"prompt": "what is the sum of the secret numbers? call the tool or answer.", "label": "7",
     "metadata": {"numbers": [3, 4]}}

The numbers live in the row's metadata (the environment's state, handed to the tool by generate.py), not in
the prompt, so the answer cannot be learned from the question: the model has to call the calculator and
read its result. The sum is drawn uniformly from 0..9 first (one word of the tiny model's vocabulary;
answering one fixed number earns ~10%), then its first part. Deterministic from --seed.

    python examples/tool_calculator/make_data.py --out data/calc_train.jsonl --num-samples 20000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

TEMPLATES = [
    "what is the sum of the secret numbers? call the tool or answer.",
    "what do the secret numbers add to? call the tool or answer.",
]


def make_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        total = rng.randrange(0, 10)
        a = rng.randrange(0, total + 1)
        rows.append({"prompt": rng.choice(TEMPLATES), "label": str(total), "metadata": {"numbers": [a, total - a]}})
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
