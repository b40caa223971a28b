"""--streaming-data: prompts read from the file as they are handed out (StreamingDataset)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO_ROOT)

from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.utils.data import StreamingDataset
from tests.args import make_args


# slime's Dataset(path, tokenizer, processor, max_length, *, prompt_key=..., label_key=..., ...)
KEYS = {"prompt_key": "prompt", "label_key": "label"}


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


def _rows(n, long_every=0):
    rows = []
    for i in range(n):
        words = 12 if long_every and i % long_every == 0 else 1
        rows.append({"prompt": "what comes after " + " ".join(["one"] * words), "label": str(i)})
    return rows


def _args(tokenizer_dir, prompt_data, **kw):
    return make_args(validate=False, **{
        "hf_checkpoint": tokenizer_dir, "prompt_data": prompt_data, "input_key": "prompt", "label_key": "label",
        "metadata_key": None, "tool_key": None, "apply_chat_template": True, "apply_chat_template_kwargs": None,
        "rollout_max_prompt_len": None, "rollout_shuffle": False, "rollout_seed": 42, "n_samples_per_prompt": 2,
        "save": None, "load": None, "buffer_filter_path": None, "disable_rollout_global_dataset": False,
        "rollout_global_dataset": True,
        "streaming_data": True, "num_data_workers": 1, **kw,
    })  # fmt: skip


def _labels(groups):
    return [g[0].label for g in groups]


def test_same_prompts_as_loading_whole_without_shuffle(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "d.jsonl", _rows(23, long_every=5)[:10] + [""] + _rows(23, long_every=5)[10:])
    kw = {"rollout_max_prompt_len": 10}  # every fifth prompt is too long: dropped up front, or skipped when read
    whole = RolloutDataSource(_args(tokenizer_dir, path, streaming_data=False, **kw))
    streaming = RolloutDataSource(_args(tokenizer_dir, path, **kw))
    assert type(streaming.dataset) is StreamingDataset and streaming.dataset_size == 23
    for n in (4, 7, 1, 12, 30):  # several epochs
        a, b = whole.get_samples(n), streaming.get_samples(n)
        assert [[s.to_dict() for s in g] for g in b] == [[s.to_dict() for s in g] for g in a]
    assert streaming.dataset.dropped > 0 and streaming.epoch_id >= 2

    sliced = RolloutDataSource(_args(tokenizer_dir, f"{path}@[-6:-1]"))
    assert sliced.dataset_size == 5 and _labels(sliced.get_samples(7)) == ["17", "18", "19", "20", "21", "17", "18"]


def test_windowed_shuffle(tmp_path):
    path = _write(tmp_path / "d.jsonl", _rows(23))
    ds = StreamingDataset(path, None, None, None, **KEYS, seed=5, window=4)
    assert [s.label for s in ds.read(0, 23)] == [str(i) for i in range(23)]  # file order until shuffled
    orders = []
    for epoch in (0, 1, 0):
        ds.shuffle(epoch)
        orders.append([int(s.label) for s in ds.read(0, 10)] + [int(s.label) for s in ds.read(10, 23)])
    assert orders[0] == orders[2] != orders[1]  # deterministic from (seed, epoch)
    for order in orders:
        assert sorted(order) == list(range(23)) and order != list(range(23))
        windows = [order[k : k + 4] for k in range(0, 23, 4)]
        assert all(len({i // 4 for i in w}) == 1 for w in windows)  # rows move only within their window


def test_resume_gives_the_same_next_prompts(tmp_path, tokenizer_dir, caplog):
    path = _write(tmp_path / "d.jsonl", _rows(40, long_every=7))
    save = str(tmp_path / "ckpt")
    kw = {"rollout_shuffle": True, "rollout_max_prompt_len": 10}

    def key(groups):
        return [[(s.label, s.prompt, s.group_index, s.index) for s in g] for g in groups]

    uninterrupted = RolloutDataSourceWithBuffer(_args(tokenizer_dir, path, **kw))
    a = RolloutDataSourceWithBuffer(_args(tokenizer_dir, path, save=save, **kw))
    for n in (16, 16):
        assert key(a.get_samples(n)) == key(uninterrupted.get_samples(n))
    handed_back = a.get_samples(3)
    uninterrupted.get_samples(3)
    a.add_samples(handed_back[1:])  # partial groups go back to the buffer and are checkpointed with it
    uninterrupted.add_samples(handed_back[1:])
    a.save(4)

    b = RolloutDataSourceWithBuffer(_args(tokenizer_dir, path, load=save, **kw))
    assert b.load(4) is True and b.epoch_id == 1
    for n in (5, 16, 16, 30):  # buffer first, then across two more epoch boundaries
        assert key(b.get_samples(n)) == key(uninterrupted.get_samples(n))

    grown = _write(tmp_path / "grown.jsonl", _rows(41))
    with caplog.at_level(logging.WARNING):
        RolloutDataSourceWithBuffer(_args(tokenizer_dir, grown, load=save, **kw)).load(4)
    assert "saved with 40 prompts in --prompt-data, now there are 41" in caplog.text


def test_errors_are_raised_when_the_row_is_read(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "bad.jsonl", _rows(3) + ["", '{"prompt": "x"}'])
    ds = RolloutDataSource(_args(tokenizer_dir, path))
    assert _labels(ds.get_samples(3)) == ["0", "1", "2"]
    with pytest.raises(ValueError, match=r"bad\.jsonl:5: missing key 'label' \(--label-key label\)"):
        ds.get_samples(1)

    too_long = _write(tmp_path / "long.jsonl", _rows(4, long_every=1))
    ds = RolloutDataSource(_args(tokenizer_dir, too_long, rollout_max_prompt_len=10))
    with pytest.raises(ValueError, match=r"no prompts left \(every prompt is longer than --rollout-max-prompt-len=10\); raise"):
        ds.get_samples(1)
    with pytest.raises(ValueError, match=r"--streaming-data reads JSONL .* convert the parquet file"):
        StreamingDataset(str(tmp_path / "d.parquet"), None, None, None, **KEYS)


MEASURE = r"""
import json, sys, threading, time
import psutil
sys.path.insert(0, sys.argv[3])
from transformers import AutoTokenizer
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from tests.args import make_args

AutoTokenizer.from_pretrained(sys.argv[1])  # imports and tokenizer code paths warmed before the baseline
proc = psutil.Process()
base = peak = proc.memory_info().rss
done = False

def sample():  # the peak of this section only (ru_maxrss would also cover the imports above)
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.005)

thread = threading.Thread(target=sample)
thread.start()
args = make_args(
    validate=False, hf_checkpoint=sys.argv[1], prompt_data=sys.argv[2], input_key="prompt", label_key="label", metadata_key="metadata",
    tool_key=None, apply_chat_template=True, apply_chat_template_kwargs=None, rollout_max_prompt_len=4096,
    rollout_shuffle=True, rollout_seed=1, n_samples_per_prompt=4, save=None, load=None, buffer_filter_path=None,
    disable_rollout_global_dataset=False, rollout_global_dataset=True, streaming_data=True, num_data_workers=1,
)
source = RolloutDataSourceWithBuffer(args)
prompts = sum(len(source.get_samples(64)) for _ in range(5))
done = True
thread.join()
peak = max(peak, proc.memory_info().rss)
print(json.dumps({"rows": source.dataset_size, "prompts": prompts, "growth": peak - base}))
"""


def test_memory_stays_flat_in_the_file_size(tmp_path, tokenizer_dir):
    pytest.importorskip("psutil")
    path = str(tmp_path / "big.jsonl")
    filler = " ".join(["what comes after one"] * 24)  # rows of ~560 bytes: a ~53 MB file
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"prompt": f"{filler} {i}", "label": str(i % 1000), "metadata": {"id": i}}) + "\n"
            for i in range(100_000)
        )
    size = os.path.getsize(path)
    assert 45 * 2**20 < size < 60 * 2**20
    out = subprocess.run([sys.executable, "-c", MEASURE, tokenizer_dir, path, REPO_ROOT],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rows"] == 100_000 and result["prompts"] == 5 * 64
    # peak RSS growth well under the file size (loading the file whole holds every prompt: more than the file)
    assert result["growth"] < size / 5, f"RSS grew {result['growth'] / 2**20:.1f} MB for a {size / 2**20:.0f} MB file"
