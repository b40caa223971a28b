"""Write the CPU toy task: "what number comes after N?" with the label N+1 (N in 0..8), as JSONL.

A tiny random-init model starts near chance (it samples the first answer word from its whole vocabulary)
and can learn the mapping from reward alone: each prompt's correct first word is one token that depends on
one prompt token, which a small transformer can attend to. The reward is `--rm-type toy`
(`slime/rollout/rm_hub/toy.py`): 1 when the response's first word equals the label.

    python tools/make_toy_data.py --out data/toy_train.jsonl --num-samples 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

TEMPLATES = [
    "what number comes after {n}?",
    "what comes after {n}?",
    "say the next number after {n}.",
    "count: {n} then what?",
]


def make_toy_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        n = rng.randrange(0, 9)
        rows.append({"prompt": rng.choice(TEMPLATES).format(n=n), "label": str(n + 1)})
    return rows


def write_toy_data(out: str, num_samples: int, seed: int) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        for row in make_toy_rows(num_samples, seed):
            f.write(json.dumps(row) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_toy_data(args.out, args.num_samples, args.seed)}")


if __name__ == "__main__":
    main()
