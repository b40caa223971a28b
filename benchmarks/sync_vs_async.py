"""The same toy job with train.py and train_async.py, one after the other, in one invocation.

    python benchmarks/sync_vs_async.py [--num-rollout 30] [--variants sync,async,fully_async] [extra train flags]

GRPO on the toy task ("what number comes after N?") with the tiny random-init Qwen3, one fsdp training rank
and one hf engine (CPU) or one GPU each (CUDA). Each variant runs as its own process with its own
TensorBoard directory; the table is read back from there:

- wall time per rollout: the mean of `perf/step_time` (the loop's wall time per rollout; start-up, i.e.
  Ray, model loading and the first weight push, is excluded and reported separately as `startup s`);
- ratio: that time divided by the sync run's (below 1: faster than sync);
- reward: `rollout/raw_reward` of the first and of the last `--tail` rollouts (mean), so one sees that the
  off-policy variants still learn; `--curve` prints every rollout's reward.

Variants: `sync` (train.py), `async` (train_async.py, default rollout, one step off), `fully_async`
(train_async.py with `slime.rollout.fully_async_rollout.generate_rollout_fully_async`).
The runs are sequential so they never share the cores; on a loaded machine the numbers carry its noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from slime.utils.tracking import read_scalars  # noqa: E402

VARIANTS = {
    "sync": ("train.py", []),
    "async": ("train_async.py", []),
    "fully_async": ("train_async.py",
                    ["--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"]),
}


def job_flags(args, model_dir: str, data_path: str) -> list[str]:
    """The toy job of scripts/run-tiny-cpu.sh (same algorithm and optimizer flags)."""
    return [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-backend", "hf",
        "--hf-checkpoint", model_dir, "--prompt-data", data_path, "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "toy",
        "--num-rollout", str(args.num_rollout), "--rollout-batch-size", str(args.rollout_batch_size),
        "--n-samples-per-prompt", "8", "--global-batch-size", str(args.rollout_batch_size * 8),
        "--micro-batch-size", "32", "--rollout-max-response-len", str(args.max_response_len),
        "--rollout-temperature", "1.0",
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.01", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--lr", "7e-4", "--weight-decay", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--clip-grad", "1.0",
    ]


def run_variant(name: str, flags: list[str], workdir: str, extra: list[str]) -> dict:
    script, variant_flags = VARIANTS[name]
    tb_dir = os.path.join(workdir, name, "tb")
    cmd = [sys.executable, os.path.join(REPO_ROOT, script), *flags, *variant_flags, "--use-tensorboard",
           "--tensorboard-dir", tb_dir, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    for var in ("SLIME_TRAIN_NUM_THREADS", "SLIME_ENGINE_NUM_THREADS", "OMP_NUM_THREADS"):
        env.setdefault(var, "1")
    log_path = os.path.join(workdir, f"{name}.log")
    print(f"[{name}] {' '.join(cmd[1:3])} ... (log: {log_path})", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir).returncode
    total = time.time() - start
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"[{name}] exited with {rc}; log tail:\n{tail}")
    steps = read_scalars(tb_dir, "perf/step_time")
    rewards = read_scalars(tb_dir, "rollout/raw_reward")
    return {"name": name, "total_s": total, "loop_s": sum(steps.values()), "steps": steps, "rewards": rewards,
            "lag": read_scalars(tb_dir, "rollout/weight_version_lag/mean"),
            "train_wait": read_scalars(tb_dir, "perf/train_wait_time_ratio")}


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def _fmt(value: float, digits: int) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # NaN: train.py does not log the metric


def report(results: list[dict], tail: int, curve: bool) -> str:
    base = _mean(results[0]["steps"].values())
    lines = [
        "| variant | rollouts | wall s / rollout | ratio vs " + results[0]["name"] + " | loop s | startup s "
        f"| reward first {tail} | reward last {tail} | weight lag (mean) | trainer wait ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        per = _mean(r["steps"].values())
        ids = sorted(r["rewards"])
        lines.append(
            f"| {r['name']} | {len(r['steps'])} | {per:.2f} | {per / base:.2f} | {r['loop_s']:.1f} "
            f"| {r['total_s'] - r['loop_s']:.1f} | {_mean(r['rewards'][i] for i in ids[:tail]):.3f} "
            f"| {_mean(r['rewards'][i] for i in ids[-tail:]):.3f} | {_fmt(_mean(r['lag'].values()), 2)} "
            f"| {_fmt(_mean(r['train_wait'].values()), 2)} |"
        )
    if curve:
        lines.append("")
        lines.append("rollout/raw_reward per rollout:")
        for r in results:
            lines.append(f"  {r['name']:>11}: " + " ".join(f"{r['rewards'][i]:.2f}" for i in sorted(r["rewards"])))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rollout", type=int, default=30)
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout (x8 samples)")
    parser.add_argument("--max-response-len", type=int, default=4)
    parser.add_argument("--variants", default="sync,async", help=f"comma-separated, from {sorted(VARIANTS)}")
    parser.add_argument("--tail", type=int, default=5, help="rollouts averaged for the first/last reward")
    parser.add_argument("--curve", action="store_true", help="print every rollout's reward")
    parser.add_argument("--model-dir", default=os.path.join(REPO_ROOT, "models", "tiny-qwen3"))
    parser.add_argument("--data", default=os.path.join(REPO_ROOT, "data", "toy_train.jsonl"))
    parser.add_argument("--workdir", default=None, help="where logs and TensorBoard files go (default: a temp dir)")
    args, extra = parser.parse_known_args()

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        from tools.make_tiny_model import make_tiny_model

        make_tiny_model(args.model_dir, size="tiny", seed=0)
    if not os.path.isfile(args.data):
        from tools.make_toy_data import write_toy_data

        write_toy_data(args.data, num_samples=20000, seed=0)

    workdir = args.workdir or tempfile.mkdtemp(prefix="slime_sync_vs_async_")
    os.makedirs(workdir, exist_ok=True)
    flags = job_flags(args, args.model_dir, args.data)
    results = [run_variant(name, flags, workdir, extra) for name in names]
    table = report(results, args.tail, args.curve)
    print(table)
    with open(os.path.join(workdir, "table.md"), "w") as f:
        f.write(table + "\n")
    print(f"(written to {os.path.join(workdir, 'table.md')})")


if __name__ == "__main__":
    main()
