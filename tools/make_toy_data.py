"""Write the CPU toy task: "what number comes after N?" with the label N+1 (N in 0..8), as JSONL.

A tiny random-init model starts near chance (it samples the first answer word from its whole vocabulary)
and can learn the mapping from reward alone: each prompt's correct first word is one token that depends on
one prompt token, which a small transformer can attend to. The reward is `--rm-type toy`
(`slime/rollout/rm_hub/toy.py`): 1 when the response's first word equals the label.

    python tools/make_toy_data.py --out data/toy_train.jsonl --num-samples 2000 --seed 0

`--task colour` writes the visual toy task instead (docs/vlm.md): an image filled with one colour (red, green or
blue, the shade jittered, the size varied), the prompt "<image> which colour fills the image?" and the colour's
name as the label, for `--multimodal-keys '{"image": "images"}'` with a vision-language model (the tiny
Qwen2.5-VL of `tools/make_tiny_model.py --arch qwen2_5_vl`). The images are PNG data URIs inside the rows.
The same `--rm-type toy` grades it; the answer is learnable only by looking at the image. `--task colour_sft`
writes the same rows as supervised chat rows (`{"messages": [user, assistant], "images": [...]}`) for the SFT
rollout with images (docs/sft.md).

`--task geo3k` writes rows in the geo3k dataset's shape that slime's `examples/geo3k_vlm_multi_turn` reads
(`--input-key problem --label-key answer --multimodal-keys '{"image": "images"}'`): a problem with one `<image>`,
a numeric answer, and the image (a filled square whose side in patches is the answer), so its plugins run offline.
"""

from __future__ import annotations

import argparse
import base64
import io
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


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def colour_image(rgb: tuple[int, int, int], size: tuple[int, int]) -> str:
    """A PNG of one colour as a data URI."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, rgb).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def make_colour_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        name = rng.choice(sorted(COLOURS))
        rgb = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[name])
        size = (28 * rng.randint(2, 4), 28 * rng.randint(2, 4))
        rows.append({"prompt": "<image> which colour fills the image?", "images": [colour_image(rgb, size)],
                     "label": name})
    return rows


def make_geo3k_rows(num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        side = rng.randint(2, 4)
        rgb = COLOURS[rng.choice(sorted(COLOURS))]
        rows.append({"problem": "<image> the square is drawn on a grid. find its side x.", "answer": str(side),
                     "images": [colour_image(rgb, (28 * side, 28 * side))]})
    return rows


def make_colour_sft_rows(num_samples: int, seed: int) -> list[dict]:
    """The colour task's rows as supervised chat rows: the prompt as the user turn, the label as the answer."""
    return [{"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["label"]}],
             "images": row["images"]} for row in make_colour_rows(num_samples, seed)]


TASKS = {"number": make_toy_rows, "colour": make_colour_rows, "colour_sft": make_colour_sft_rows,
         "geo3k": make_geo3k_rows}


def write_toy_data(out: str, num_samples: int, seed: int, task: str = "number") -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        for row in TASKS[task](num_samples, seed):
            f.write(json.dumps(row) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="number", choices=sorted(TASKS))
    args = parser.parse_args()
    print(f"wrote {write_toy_data(args.out, args.num_samples, args.seed, args.task)}")


if __name__ == "__main__":
    main()
