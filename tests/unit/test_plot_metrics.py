"""tools/plot_metrics.py on small TensorBoard runs written here with torch's SummaryWriter: the PNGs it writes
are real images, missing tags are notes, a dir without event files is an error naming the dir."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from tools.plot_metrics import band, main, moving_average

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(logdir, steps: int = 12, reward_offset: float = 0.0) -> str:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(logdir)) as w:
        for step in range(steps):
            w.add_scalar("rollout/raw_reward", reward_offset + 0.05 * step, step)
            w.add_scalar("rollout/response_len/mean", 3.0 + step % 2, step)
            w.add_scalar("train/loss", 1.0 / (step + 1), step)
            w.add_scalar("train/kl_loss", 0.001 * step, step)
            w.add_scalar("perf/step_time", 2.0, step)
            w.add_scalar("perf/train_time", 1.5, step)
    return str(logdir)


def assert_png(path: str) -> None:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    assert os.path.getsize(path) > 5_000, (path, os.path.getsize(path))
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01, f"{path} is a blank image"


def test_moving_average_is_trailing_mean():
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([1.0, 2.0, 6.0], 5) == [1.0, 1.5, 3.0]
    assert moving_average([4.0, 2.0], 1) == [4.0, 2.0]


def test_cli_writes_one_png_per_group_present(tmp_path):
    run = write_run(tmp_path / "tb" / "run1")
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "tools/plot_metrics.py", run, "--out", str(out), "--smooth", "3"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = [str(out / f"{g}.png") for g in ("reward", "kl", "response_len", "timing", "loss")]
    assert proc.stdout.split() == expected
    for path in expected:
        assert_png(path)
    # Tags this run lacks are notes, not errors.
    assert "train/ppo_kl" in proc.stderr and "eval/*" in proc.stderr and "rollout/response_len/max" in proc.stderr


def test_compare_runs_and_tags(tmp_path, capsys):
    sync = write_run(tmp_path / "sync", steps=10)
    async_ = write_run(tmp_path / "async", steps=8, reward_offset=0.2)
    rc = main([sync, async_, "--out", str(tmp_path / "cmp"), "--prefix", "cmp_", "--dpi", "60",
               "--tags", "rollout/raw_reward", "perf/*_time"])  # fmt: skip
    assert rc == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "cmp" / "cmp_tags.png")]
    assert_png(str(tmp_path / "cmp" / "cmp_tags.png"))


def test_band_is_median_and_range_per_step():
    steps, median, low, high = band([{0: 1.0, 1: 4.0}, {0: 3.0, 1: 2.0, 2: 7.0}, {0: 2.0, 1: 9.0}])
    assert steps == [0, 1, 2]
    assert median == [2.0, 4.0, 7.0] and low == [1.0, 2.0, 7.0] and high == [3.0, 9.0, 7.0]
    assert band([{0: 1.0}, {0: 2.0}])[1] == [1.5]  # an even count: the mean of the middle two


def test_band_of_seeds_writes_one_figure(tmp_path, capsys):
    runs = [write_run(tmp_path / f"seed{i}", steps=10, reward_offset=0.1 * i) for i in range(3)]
    rc = main([*runs, "--band", "--smooth", "3", "--out", str(tmp_path / "band"), "--tags", "rollout/raw_reward"])
    assert rc == 0
    assert_png(str(tmp_path / "band" / "tags.png"))


def test_band_line_draws_a_named_run_and_refuses_an_unknown_label(tmp_path, capsys):
    runs = [write_run(tmp_path / f"seed{i}", steps=10, reward_offset=0.1 * i) for i in range(3)]
    common = [*runs, "--labels", "a", "b", "c", "--band", "--tags", "rollout/raw_reward"]
    assert main([*common, "--band-line", "b", "--out", str(tmp_path / "one")]) == 0
    assert_png(str(tmp_path / "one" / "tags.png"))
    assert main([*common, "--band-line", "z", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--band-line z" in err and "'a', 'b', 'c'" in err
    with pytest.raises(SystemExit):  # without --band the line would be drawn as any other run: refused
        main([*runs, "--band-line", "a", "--labels", "a", "b", "c", "--out", str(tmp_path / "nb")])
    assert "add --band" in capsys.readouterr().err


def test_no_event_files_is_an_error_naming_the_dir(tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main([str(empty), "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert "no TensorBoard event files" in err and str(empty) in err
    assert not (tmp_path / "plots").exists()

    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "plots")]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_no_wanted_tag_is_an_error_listing_the_tags_there(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main([run, "--out", str(tmp_path / "plots"), "--tags", "train/grad_norm"]) == 2
    err = capsys.readouterr().err
    assert "train/grad_norm" in err and "rollout/raw_reward" in err


def test_missing_matplotlib_names_the_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main([str(tmp_path)]) == 2
    assert 'pip install -e ".[plot]"' in capsys.readouterr().err
