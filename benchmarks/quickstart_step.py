"""The CPU quick start's step, two checkouts side by side in one invocation (CPU).

    python benchmarks/quickstart_step.py --before /tmp/old-checkout [--after .] [--rollouts 60] [--skip 10]
                                         [--script scripts/run-tiny-cpu-vlm.sh]

Runs README command 1 (`scripts/run-tiny-cpu.sh`, seed 1234) with `NUM_ROLLOUT=--rollouts` in both checkouts at
once, each importing its own `slime` (PYTHONPATH), so both see the same load on the machine, then prints the median
`perf/*` seconds of the rollouts from `--skip` on (the first ones pay start-up and warm-up) and whether the two runs
logged the same rewards and training metrics, bit for bit (a change that keeps the algorithm's arithmetic keeps
them; a new rounding shows here first). `--before` is a second checkout of the repository, e.g. one made with
`git worktree add --detach /tmp/old-checkout <commit>`; its `models/` and `data/` are linked to this one's.
`--script`: another CPU quick start, e.g. the visual one (scripts/run-tiny-cpu-vlm.sh, docs/vlm.md; its own seed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = ("step_time", "rollout_time", "train_time", "update_weights_time")
SAME = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm")


def start(checkout: str, rollouts: int, tb: str, log: str, script: str) -> subprocess.Popen:
    for shared in ("models", "data"):  # the tiny model and the toy data, made once
        target = os.path.join(checkout, shared)
        if not os.path.exists(target) and os.path.isdir(os.path.join(REPO_ROOT, shared)):
            os.symlink(os.path.join(REPO_ROOT, shared), target)
    env = dict(os.environ, NUM_ROLLOUT=str(rollouts), PYTHONPATH=checkout)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", script, "--use-tensorboard", "--tensorboard-dir", tb], cwd=checkout,
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def scalars(tb: str) -> dict[str, dict[int, float]]:
    events = EventAccumulator(tb, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout (the baseline)")
    p.add_argument("--after", default=REPO_ROOT, help="this checkout by default")
    p.add_argument("--rollouts", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="rollouts left out of the medians")
    p.add_argument("--script", default="scripts/run-tiny-cpu.sh", help="the quick start to run (README command 1)")
    cli = p.parse_args()
    out = tempfile.mkdtemp(prefix="quickstart_step_")
    runs = {name: (os.path.abspath(path), os.path.join(out, name)) for name, path in
            (("before", cli.before), ("after", cli.after))}
    procs = {name: start(path, cli.rollouts, tb, tb + ".log", cli.script) for name, (path, tb) in runs.items()}
    try:
        codes = {name: proc.wait() for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    if any(codes.values()):
        sys.exit(f"a run failed: exit codes {codes}; logs under {out}")
    logged = {name: scalars(tb) for name, (_, tb) in runs.items()}
    print(f"{cli.script}, {cli.rollouts} rollouts each, both at once; medians of rollouts "
          f"{cli.skip}-{cli.rollouts - 1} (s)\n")
    print("| | " + " | ".join(TIMES) + " |\n| --- |" + " ---: |" * len(TIMES))
    for name, (path, _) in runs.items():
        medians = [statistics.median(v for k, v in logged[name].get(f"perf/{t}", {}).items() if k >= cli.skip)
                   if logged[name].get(f"perf/{t}") else float("nan") for t in TIMES]
        print(f"| {name} ({path}) | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
    print()
    for tag in SAME:
        a, b = logged["before"].get(tag, {}), logged["after"].get(tag, {})
        differ = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        print(f"{tag}: {'the same in every rollout' if not differ else f'differs from rollout {differ[0]} on'}")
    print(f"\nlogs and TensorBoard: {out}")


if __name__ == "__main__":
    main()
