"""Write a chat SFT dataset for the tiny CPU model, as JSONL rows of slime's SFT format ({"messages": [...]}).

Each conversation counts on from a number in two user turns, in the words of the tiny model's vocabulary:

    {"messages": [{"role": "system", "content": "you are a helpful math tutor"},
                  {"role": "user", "content": "what number comes after 3 ?"},
                  {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "and then ?"},
                  {"role": "assistant", "content": "5"}]}

The answers follow from the prompt (the system line is there in half the rows), so a model can learn them:
the SFT loss of the assistant turns falls from the random model's ~ln(vocabulary) towards the cost of the
prompt-independent parts. Deterministic from --seed.

    python examples/sft/make_data.py --out data/sft_train.jsonl --num-samples 64 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

QUESTIONS = ["what number comes after {n} ?", "what comes after {n} ?", "say the next number after {n} ."]
FOLLOW_UPS = ["and then ?", "and after that ?", "next ?"]


def make_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        n = rng.randrange(0, 8)
        messages = [{"role": "system", "content": "you are a helpful math tutor"}] if rng.random() < 0.5 else []
        messages += [
            {"role": "user", "content": rng.choice(QUESTIONS).format(n=n)},
            {"role": "assistant", "content": str(n + 1)},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
            {"role": "assistant", "content": str(n + 2)},
        ]
        rows.append({"messages": messages})
    return rows


def write_rows(out: str, num_samples: int, seed: int) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        for row in make_rows(num_samples, seed):
            f.write(json.dumps(row) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {write_rows(args.out, args.num_samples, args.seed)}")


if __name__ == "__main__":
    main()
