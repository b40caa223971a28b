"""Memory of the prompt data source: `--streaming-data` against loading `--prompt-data` whole.

    python benchmarks/streaming_data_memory.py [--size-mb 1024] [--non-streaming-mb 100] [--rollouts 10]

Writes a synthetic JSONL of about `--size-mb` MB (rows of ~650 bytes: chat messages, a label, metadata)
in a temporary folder and, each in a fresh process, builds the default data source
(`RolloutDataSourceWithBuffer`) with the tiny tokenizer of `tools/make_tiny_model.py`, with
`--apply-chat-template`, `--rollout-max-prompt-len` and `--rollout-shuffle`, and takes `--rollouts`
rollouts of `--rollout-batch-size` prompt groups from it. Reported per run: seconds (source creation plus
the rollouts) and the peak RSS increase over the process after its imports and one tokenizer load
(sampled every 5 ms with psutil). `--non-streaming-mb` (0: skip) adds the whole-file load of a smaller
file of that size, for comparison, once per `--num-data-workers` count (e.g. `--num-data-workers 1,2`;
the peak RSS is the main process's, not the workers').
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ["what", "number", "comes", "after", "before", "plus", "minus", "times", "the", "sum", "of", "and", "is",
         "please", "answer", "step", "think"]  # fmt: skip


def write_jsonl(path: str, size_mb: float) -> int:
    """A JSONL file of about `size_mb` MB; returns its row count."""
    target = int(size_mb * 1024 * 1024)
    filler = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(80))
    written = rows = 0
    with open(path, "w") as f:
        while written < target:
            lines = []
            for _ in range(1000):
                row = {
                    "messages": [
                        {"role": "system", "content": "you are a helpful math tutor"},
                        {"role": "user", "content": f"{filler} what comes after {rows % 10}? row {rows}"},
                    ],
                    "label": str(rows % 10 + 1),
                    "metadata": {"id": rows, "source": "synthetic", "rm_type": "toy"},
                }
                lines.append(json.dumps(row))
                rows += 1
            text = "\n".join(lines) + "\n"
            f.write(text)
            written += len(text)
    return rows


CHILD = r"""
import json, os, sys, threading, time
import psutil
sys.path.insert(0, REPO_ROOT)
from transformers import AutoTokenizer
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from tests.args import make_args

tokenizer_dir, path, streaming, rollouts, batch, workers = sys.argv[1], sys.argv[2], sys.argv[3] == "1", *map(int, sys.argv[4:7])
AutoTokenizer.from_pretrained(tokenizer_dir)  # code paths and caches warmed before the baseline
proc = psutil.Process()
base = proc.memory_info().rss
peak = base
done = False

def sample():
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.005)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
args = make_args(hf_checkpoint=tokenizer_dir, prompt_data=path, input_key="messages", label_key="label",
                 apply_chat_template=True, rollout_max_prompt_len=4096, rollout_shuffle=True,
                 n_samples_per_prompt=1, global_batch_size=2, streaming_data=streaming, num_data_workers=workers)
start = time.perf_counter()
source = RolloutDataSourceWithBuffer(args)
created = time.perf_counter() - start
prompts = 0
for _ in range(rollouts):
    prompts += len(source.get_samples(batch))
seconds = time.perf_counter() - start
done = True
thread.join()
peak = max(peak, proc.memory_info().rss)
print(json.dumps({"rows": source.dataset_size, "prompts": prompts, "create_s": created, "seconds": seconds,
                  "peak_mb": (peak - base) / 2**20, "end_mb": (proc.memory_info().rss - base) / 2**20}))
""".replace("REPO_ROOT", repr(REPO_ROOT))


def measure(tokenizer_dir: str, path: str, streaming: bool, rollouts: int, batch: int, workers: int = 1) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tokenizer_dir, path, "1" if streaming else "0", str(rollouts), str(batch),
         str(workers)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024, help="Size of the streamed file (default 1 GB).")
    p.add_argument("--non-streaming-mb", type=float, default=100, help="Size for the whole-file load (0: skip).")
    p.add_argument("--num-data-workers", default="1", help="Worker counts of the whole-file load, e.g. 1,2.")
    p.add_argument("--rollouts", type=int, default=10)
    p.add_argument("--rollout-batch-size", type=int, default=256)
    p.add_argument("--tmp-dir", default=None, help="Where to write the files (default: the system temp dir).")
    opts = p.parse_args()

    sys.path.insert(0, REPO_ROOT)
    from tools.make_tiny_model import build_tokenizer

    with tempfile.TemporaryDirectory(dir=opts.tmp_dir) as tmp:
        tokenizer_dir = os.path.join(tmp, "tokenizer")
        build_tokenizer(tokenizer_dir)
        runs = [(opts.size_mb, True, 1)]
        if opts.non_streaming_mb > 0:
            runs += [(opts.non_streaming_mb, False, int(w)) for w in opts.num_data_workers.split(",")]
        results = []
        for size_mb, streaming, workers in runs:
            path = os.path.join(tmp, f"prompts_{size_mb:g}mb.jsonl")
            if not os.path.exists(path):
                write_jsonl(path, size_mb)
            r = measure(tokenizer_dir, path, streaming, opts.rollouts, opts.rollout_batch_size, workers)
            mode = "streaming" if streaming else f"whole file, {workers} worker{'s' * (workers > 1)}"
            results.append((os.path.getsize(path) / 2**20, mode, r))

    print(f"\n{opts.rollouts} rollouts x {opts.rollout_batch_size} prompts, chat template + length filter + shuffle\n")
    print("| file MB | rows | mode | create s | total s | peak RSS increase MB | RSS increase at end MB |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for size, mode, r in results:
        print(f"| {size:.0f} | {r['rows']} | {mode} | {r['create_s']:.1f} | {r['seconds']:.1f} | "
              f"{r['peak_mb']:.1f} | {r['end_mb']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
