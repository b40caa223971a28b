"""Plot a run's TensorBoard scalars to PNG files (matplotlib, Agg backend: no display needed).

    python tools/plot_metrics.py outputs/tensorboard/slime/<run> [--out DIR] [--smooth N]
    python tools/plot_metrics.py RUN_A RUN_B --labels sync async --out plots/   # compare runs
    python tools/plot_metrics.py RUN --tags 'rollout/response_len/*' train/grad_norm
    python tools/plot_metrics.py SEED_1 SEED_2 ... --band --smooth 10      # median and range over runs
    python tools/plot_metrics.py S1234 S1 S2 --labels 1234 1 2 --band --band-line 1234   # and one run's line

By default one figure per group (reward, kl, response_len, timing, loss), with one panel per tag and, in each
panel, one line per run (the legend names the runs), against the step, which is the rollout id. `--band` draws
the runs as one: the median over runs at each step and the range (min to max) shaded, e.g. for one job run with
several seeds; with `--smooth N` each run is smoothed first; `--band-line LABEL` draws that run's own line over
the band. `--tags`
replaces the groups with one figure of the given tags. Tag names may be shell-style patterns (`perf/*_time`).
Tags a run lacks are skipped with a note; a group none of the runs has is skipped. Writes
`<out>/<prefix><group>.png` and prints each path.

Simplifications: `--smooth N` is a trailing moving average over the last N logged points (not over N steps,
which differ where steps are missing, e.g. eval every k rollouts); the raw values stay drawn, faint. Every
event file under a run dir counts (as in `read_scalars`), so a restarted run that logs again into the same
dir shows the later value of a step. Needs `pip install -e .[plot]` (matplotlib).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import importlib.util
import math
import os
import sys

from slime.utils.tracking import read_scalars

GROUPS: dict[str, tuple[str, ...]] = {
    "reward": ("rollout/raw_reward", "eval/*"),
    "kl": ("train/kl_loss", "train/ppo_kl"),
    "response_len": ("rollout/response_len/mean", "rollout/response_len/max"),
    "timing": ("perf/*_time",),
    "loss": ("train/loss", "train/pg_loss", "train/entropy_loss"),
}


class PlotError(Exception):
    """A user-facing error: printed as `error: ...` and exit status 2."""


def event_files(run_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True))


def list_scalar_tags(run_dir: str) -> set[str]:
    """Every scalar tag in the event files under `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in event_files(run_dir):
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 1, "histograms": 1, "images": 1})
        acc.Reload()
        tags.update(acc.Tags()["scalars"])
    return tags


def match_tags(patterns: tuple[str, ...] | list[str], available: set[str]) -> list[str]:
    """The available tags each pattern names, in pattern order (sorted within a pattern), each once."""
    out: list[str] = []
    for pattern in patterns:
        for tag in sorted(fnmatch.filter(available, pattern)):
            if tag not in out:
                out.append(tag)
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_labels(run_dirs: list[str], labels: list[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(run_dirs):
            raise PlotError(f"--labels has {len(labels)} names for {len(run_dirs)} run dirs; give one per run dir")
        return labels
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def band(series: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, median, min, max) over the runs that logged each step."""
    steps = sorted(set().union(*series))
    median, low, high = [], [], []
    for step in steps:
        values = sorted(s[step] for s in series if step in s)
        mid = len(values) // 2
        median.append(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2)
        low.append(values[0])
        high.append(values[-1])
    return steps, median, low, high


def plot_band(ax, tag: str, runs: list[tuple[str, dict[str, dict[int, float]]]], smooth: int) -> None:
    series = []
    for _, scalars in runs:
        if tag in scalars:
            steps = sorted(scalars[tag])
            values = [scalars[tag][s] for s in steps]
            series.append(dict(zip(steps, moving_average(values, smooth) if smooth > 1 else values)))
    if not series:
        return
    steps, median, low, high = band(series)
    color = "C0"  # the first colour of the cycle; the runs drawn over the band take the next ones
    ax.fill_between(steps, low, high, alpha=0.25, linewidth=0, color=color, label=f"range of {len(series)} runs")
    ax.plot(steps, median, linewidth=1.8, color=color, label=f"median of {len(series)} runs")


def plot_figure(title: str, tags: list[str], runs: list[tuple[str, dict[str, dict[int, float]]]], path: str,
                smooth: int, dpi: int, as_band: bool = False, band_lines: tuple[str, ...] = ()) -> None:  # fmt: skip
    """One panel per tag, one line per run that has the tag (or, `as_band`, their median and range, and a line for
    each run named in `band_lines`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 1 if len(tags) == 1 else 2
    nrows = math.ceil(len(tags) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.2 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, tag in zip(axes.flat, tags):
        for i, (label, scalars) in enumerate([r for r in runs if r[0] in band_lines] if as_band else runs):
            if tag not in scalars:
                continue
            steps = sorted(scalars[tag])
            values = [scalars[tag][s] for s in steps]
            color = colors[(i + 1 if as_band else i) % len(colors)]  # the band's median takes the first colour
            marker = "o" if len(steps) <= 20 else None
            if smooth > 1 and as_band:
                ax.plot(steps, moving_average(values, smooth), color=color, linewidth=1.4, linestyle="--", label=label)
            elif smooth > 1:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1, marker=marker, markersize=3)
                ax.plot(steps, moving_average(values, smooth), color=color, linewidth=1.8, label=label)
            else:
                ax.plot(steps, values, color=color, linewidth=1.5, marker=marker, markersize=3, label=label)
        if as_band:
            plot_band(ax, tag, runs, smooth)
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(tags) :]:
        ax.set_visible(False)
    fig.suptitle(title + (f" (moving average over {smooth} points)" if smooth > 1 else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_runs(run_dirs: list[str], out_dir: str, groups: dict[str, tuple[str, ...]], labels: list[str] | None = None,
              smooth: int = 1, prefix: str = "", dpi: int = 100, log=None,
              as_band: bool = False, band_lines: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """Write one PNG per group that any run has a tag of; returns the paths written. Notes go to `log`
    (default: stderr, so that stdout is only the paths)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    for d in run_dirs:
        if not os.path.isdir(d):
            raise PlotError(f"run dir {d!r} does not exist")
        if not event_files(d):
            raise PlotError(f"no TensorBoard event files (events.out.tfevents.*) under run dir {d!r}; "
                            "pass the --tensorboard-dir of a run that used --use-tensorboard")  # fmt: skip
    names = run_labels(run_dirs, labels)
    unknown = sorted(set(band_lines) - set(names))
    if unknown:
        raise PlotError(f"--band-line {' '.join(unknown)}: no run is labelled so; the runs: {names}")
    available = [list_scalar_tags(d) for d in run_dirs]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for group, patterns in groups.items():
        tags = match_tags(patterns, set().union(*available))
        for name, tags_of_run in zip(names, available):
            missing = [p for p in patterns if not fnmatch.filter(tags_of_run, p)]
            if missing:
                log(f"note: {name}: no {', '.join(missing)}; skipped")
        if not tags:
            log(f"note: no run has a tag of group {group!r}; no figure")
            continue
        runs = [(name, {t: read_scalars(d, t) for t in tags if t in tags_of_run})
                for name, d, tags_of_run in zip(names, run_dirs, available)]  # fmt: skip
        path = os.path.join(out_dir, f"{prefix}{group}.png")
        title = ", ".join(tags) if group == "tags" else group  # --tags: the figure is named by its tags
        plot_figure(title, tags, runs, path, smooth, dpi, as_band, band_lines)
        written.append(path)
    if not written:
        wanted = sorted({p for patterns in groups.values() for p in patterns})
        raise PlotError(f"none of the tags {wanted} is in {run_dirs}; "
                        f"tags there: {sorted(set().union(*available))}")  # fmt: skip
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="TensorBoard dir(s) of the run(s).")
    parser.add_argument("--out", default="plots", help="Folder for the PNG files (default: ./plots).")
    parser.add_argument("--tags", nargs="+", help="Plot these tags (patterns allowed) as one figure, not the groups.")
    parser.add_argument("--labels", nargs="+", help="Legend name per run dir (default: the dir names).")
    parser.add_argument("--smooth", type=int, default=1, help="Moving average over N points (default 1: off).")
    parser.add_argument("--prefix", default="", help="File name prefix, e.g. `quickstart_` -> quickstart_reward.png.")
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument("--band", action="store_true",
                        help="Draw the runs as one: their median per step and their range shaded (e.g. seeds).")
    parser.add_argument("--band-line", nargs="+", default=[], metavar="LABEL",
                        help="With --band, also draw these runs (by label) as lines, e.g. the default seed's.")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: must be >= 1 (1 turns smoothing off)")
    if args.band_line and not args.band:
        parser.error(f"--band-line {' '.join(args.band_line)}: draws a run over the band; add --band")
    groups = {"tags": tuple(args.tags)} if args.tags else GROUPS
    if importlib.util.find_spec("matplotlib") is None:
        print('error: tools/plot_metrics.py needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)',
              file=sys.stderr)
        return 2
    try:
        written = plot_runs(args.run_dirs, args.out, groups, args.labels, args.smooth, args.prefix, args.dpi,
                            as_band=args.band, band_lines=tuple(args.band_line))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
