"""Dataset (JSONL -> Samples) and the rollout data sources (groups, epochs, checkpoint state, buffer)."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.config.arguments import SlimeArgumentError, parse_args
from slime.utils.data import (
    Dataset,
    _parse_generalized_path,
    filter_long_prompt,
    parse_prompt_path,
    process_rollout_data,
    read_file,
)
from slime.utils.types import Sample
from tests.args import make_args

HERE = __file__


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# slime's Dataset(path, tokenizer, processor, max_length, *, prompt_key=..., label_key=..., ...)
KEYS = {"prompt_key": "prompt", "label_key": "label"}


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _rows(n):
    return [{"prompt": f"what comes after {i % 10}?", "label": str(i), "meta": {"i": i}} for i in range(n)]


def lifo(args, rollout_id, buffer, num_samples):
    """A --buffer-filter-path plugin: newest groups first."""
    taken = buffer[-num_samples:][::-1]
    del buffer[-num_samples:]
    return taken


# --- Dataset -------------------------------------------------------------------------------------------


def test_dataset_plain_and_chat_template(tmp_path, tokenizer):
    rows = [
        {"prompt": "what comes after 3?", "label": "4", "meta": '{"rm_type": "toy"}', "tools": [{"name": "calc"}]},
        {"prompt": [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hi"}], "label": "x"},
    ]
    path = _write(tmp_path / "d.jsonl", rows)
    plain = Dataset(path, tokenizer, None, None, **KEYS, metadata_key="meta", tool_key="tools")
    assert plain[0].prompt == "what comes after 3?"
    assert plain[0].metadata == {"rm_type": "toy", "tools": [{"name": "calc"}]}  # JSON-string metadata parsed
    assert plain[1].prompt == rows[1]["prompt"]  # messages kept as given without the template
    assert plain[0].tokens == [] and plain[0].status == Sample.Status.PENDING

    chat = Dataset(path, tokenizer, None, None, **KEYS, apply_chat_template=True)
    assert chat[0].prompt == "<|im_start|>user\nwhat comes after 3?<|im_end|>\n<|im_start|>assistant\n"
    assert chat[1].prompt == (
        "<|im_start|>system\nyou are helpful<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [s.label for s in chat] == ["4", "x"]


def test_dataset_errors_name_file_line_and_key(tmp_path, tokenizer):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "label": "1"}, "", '{"prompt": "b", "label": ', {}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        Dataset(path, tokenizer, None, None, **KEYS)

    path = _write(tmp_path / "missing.jsonl", [{"prompt": "a", "label": "1"}, {"question": "b", "label": "2"}])
    with pytest.raises(
        ValueError,
        match=r"missing\.jsonl:2: missing key 'prompt' \(--input-key prompt\); keys present: \['label', 'question'\]",
    ):
        Dataset(path, tokenizer, None, None, **KEYS)
    with pytest.raises(ValueError, match=r"missing\.jsonl:1: missing key 'answer' \(--label-key answer\)"):
        Dataset(path, tokenizer, None, None, prompt_key="prompt", label_key="answer")

    path = _write(tmp_path / "type.jsonl", [{"prompt": 5, "label": "1"}])
    with pytest.raises(ValueError, match=r"type\.jsonl:1: 'prompt' must be a string or a list"):
        Dataset(path, tokenizer, None, None, **KEYS)
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        Dataset(str(tmp_path / "nope.jsonl"), tokenizer, None, None, **KEYS)


def test_dataset_drops_long_prompts(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "one two", "label": "a"}, {"prompt": "one two three four five", "label": "b"},
            {"prompt": [{"role": "user", "content": "one"}], "label": "c"}]  # fmt: skip
    path = _write(tmp_path / "len.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = Dataset(path, tokenizer, None, 4, **KEYS)
    # "one two" is 2 tokens: kept; 5 words: dropped; the message is measured through the template (6 tokens): dropped
    assert [s.label for s in ds] == ["a"]
    assert "dropped 2 of 3 prompts longer than --rollout-max-prompt-len=4" in caplog.text
    with_template = Dataset(path, tokenizer, None, 7, **KEYS, apply_chat_template=True)
    # rendered: "one two" -> 7 tokens (kept), five words -> 10 (dropped), "one" -> 6 (kept)
    assert [s.label for s in with_template] == ["a", "c"]


def test_dataset_shuffle_is_deterministic(tmp_path, tokenizer):
    path = _write(tmp_path / "s.jsonl", _rows(30))
    a = Dataset(path, tokenizer, None, None, **KEYS, seed=5)
    b = Dataset(path, tokenizer, None, None, **KEYS, seed=5)
    file_order = [s.label for s in a]
    a.shuffle(1)
    b.shuffle(2)
    b.shuffle(1)  # independent of earlier shuffles
    assert [s.label for s in a] == [s.label for s in b] != file_order
    assert sorted(s.label for s in a) == sorted(file_order)
    a.shuffle(2)
    assert [s.label for s in a] != [s.label for s in b]


# --- row slices: PATH@[start:end] ----------------------------------------------------------------------


def test_parse_prompt_path():
    assert parse_prompt_path("d.jsonl") == ("d.jsonl", None)
    assert parse_prompt_path("d.jsonl@[2:5]") == ("d.jsonl", slice(2, 5))
    assert parse_prompt_path("a@[b]/d.jsonl@[:-3]") == ("a@[b]/d.jsonl", slice(None, -3))
    assert parse_prompt_path("d.jsonl@[-10:]") == ("d.jsonl", slice(-10, None))
    assert parse_prompt_path("d.jsonl@[:]") == ("d.jsonl", slice(None, None))
    for bad in ("d.jsonl@[3]", "d.jsonl@[a:b]", "d.jsonl@[1:2:3]", "d.jsonl@[1:2", "d.jsonl@[1.5:]"):
        with pytest.raises(ValueError, match=r"--eval-prompt-data .*: malformed row slice; write PATH@\[start:end\]"):
            parse_prompt_path(bad, "--eval-prompt-data")


def test_slice_selects_rows_before_filter_and_shuffle(tmp_path, tokenizer):
    rows = _rows(10)
    rows[3]["prompt"] = "one two three four five six seven eight nine ten"  # over the limit below
    path = _write(tmp_path / "d.jsonl", rows[:4] + [""] + rows[4:])  # a blank line is not a row

    def labels(ds):
        return [s.label for s in ds]

    assert labels(Dataset(f"{path}@[2:6]", tokenizer, None, None, **KEYS)) == ["2", "3", "4", "5"]
    assert labels(Dataset(f"{path}@[-3:]", tokenizer, None, None, **KEYS)) == ["7", "8", "9"]
    assert labels(Dataset(f"{path}@[:-8]", tokenizer, None, None, **KEYS)) == ["0", "1"]
    # the slice is taken first, then the length filter drops row 3 (6 prompts were sliced, 5 are left)
    assert labels(Dataset(f"{path}@[1:7]", tokenizer, None, 6, **KEYS)) == ["1", "2", "4", "5", "6"]
    a = Dataset(f"{path}@[5:]", tokenizer, None, None, **KEYS, seed=3)
    a.shuffle(0)
    assert sorted(labels(a)) == ["5", "6", "7", "8", "9"]
    with pytest.raises(ValueError, match=r"--prompt-data .*d\.jsonl@\[x:\]: malformed row slice"):
        Dataset(f"{path}@[x:]", tokenizer, None, None, **KEYS)


def test_errors_name_the_file_line_after_a_slice(tmp_path, tokenizer):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "label": "1"}, "", "", {"prompt": "b"}, {"label": "3"}])
    Dataset(f"{path}@[:1]", tokenizer, None, None, **KEYS)  # the bad rows are not selected: not read
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: missing key 'label' \(--label-key label\)"):
        Dataset(f"{path}@[1:]", tokenizer, None, None, **KEYS)
    with pytest.raises(ValueError, match=r"bad\.jsonl:5: missing key 'prompt' \(--input-key prompt\)"):
        Dataset(f"{path}@[-1:]", tokenizer, None, None, **KEYS)


# --- slime's names: read_file, filter_long_prompt, process_rollout_data, the keyword signature ----------


def test_read_file_yields_rows_of_a_slice_and_names_bad_lines(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"id": i} for i in range(4)] + [""] + [{"id": i} for i in range(4, 10)])
    assert [r["id"] for r in read_file(path)] == list(range(10))  # the blank line is not a row
    assert [r["id"] for r in read_file(path + "@[-3:]")] == [7, 8, 9]
    assert [r["id"] for r in read_file(path + "@[2:-6]")] == [2, 3]
    assert _parse_generalized_path(path + "@[-3:]") == (path, slice(-3, None))
    bad = _write(tmp_path / "bad.jsonl", [{"id": 0}, "", "{oops"])
    rows = read_file(bad)
    assert next(rows) == {"id": 0}  # rows come one at a time: the bad line fails only when reached
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        next(rows)
    with pytest.raises(FileNotFoundError, match="nope.jsonl: file not found"):
        list(read_file(str(tmp_path / "nope.jsonl")))


class _CountingProcessor:
    """A processor whose prompts cost one token a word plus 3 an image (as an image expands in a VLM)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text=None, images=None, **kwargs):
        self.calls += 1
        return {"input_ids": [[0] * (len(text.split()) + 3 * len(images or []))]}


def test_filter_long_prompt_keeps_order_and_counts_media(tokenizer):
    prompts = ["one two", "one two three four five six", "one", "one two", "one"]
    media = [None, None, {"images": ["a", "b"]}, {"images": None, "videos": None}, {"images": ["a"]}]
    samples = [Sample(prompt=p, multimodal_inputs=m, label=str(i)) for i, (p, m) in enumerate(zip(prompts, media))]
    processor = _CountingProcessor()
    kept = filter_long_prompt(samples, tokenizer, processor, max_length=5)
    # 6 words: over; "one" + 2 images = 7: over; "one" + 1 image = 4: kept; without media: by the tokenizer
    assert [s.label for s in kept] == ["0", "3", "4"] and processor.calls == 2
    assert [s.label for s in filter_long_prompt(samples, tokenizer, None, max_length=3)] == ["0", "2", "3", "4"]
    assert filter_long_prompt(samples, tokenizer, processor, None) is samples


class _Box:
    def __init__(self, inner):
        self.inner = inner


def test_process_rollout_data_lines_the_batch_lists_up_with_the_rank():
    whole = {"raw_reward": [0, 1, 2, 3], "total_lengths": [10, 11, 12, 13]}
    boxes = [_Box({**whole, "partition": [3, 0], "response_lengths": [5, 2]}),
             _Box({**whole, "partition": [1, 2], "response_lengths": [3, 4]})]  # fmt: skip
    rank1 = process_rollout_data(None, boxes, dp_rank=1, dp_size=2)
    assert rank1["total_lengths"] == [11, 12] and rank1["local_raw_reward"] == [1, 2]
    assert rank1["raw_reward"] == [0, 1, 2, 3] and boxes[1].inner["total_lengths"] == [10, 11, 12, 13]
    assert "local_raw_reward" not in process_rollout_data(None, [_Box({"partition": [0], "total_lengths": [4]})], 0, 1)
    with pytest.raises(ValueError, match="2 payloads for dp_size=4"):
        process_rollout_data(None, boxes, 0, 4)


def test_slime_signature_positional_and_keyword_forms_read_the_same(tmp_path, tokenizer):
    path = _write(tmp_path / "d.jsonl", [{"text": "one two", "metadata": {"k": 1}}, {"text": "one two three"}])
    slime_style = Dataset(path, tokenizer, None, 2)  # slime's defaults: prompt_key "text", metadata_key "metadata"
    keywords = Dataset(path=path, tokenizer=tokenizer, processor=None, max_length=2, prompt_key="text")
    assert [s.to_dict() for s in slime_style] == [s.to_dict() for s in keywords]
    with pytest.raises(TypeError, match="max_prompt_len"):  # the names these classes took before slime's are gone
        Dataset(path, tokenizer, max_prompt_len=2)
    assert [(s.prompt, s.metadata) for s in slime_style] == [("one two", {"k": 1})]
    assert slime_style.epoch_id == -1
    ds = Dataset(_write(tmp_path / "s.jsonl", [{"text": str(i)} for i in range(20)]), None, seed=1)
    ds.shuffle(3)
    order = [s.prompt for s in ds]
    ds.samples.reverse()
    ds.shuffle(3)  # the epoch it already has: nothing changes
    assert ds.epoch_id == 3 and [s.prompt for s in ds] == order[::-1]


def _argv(files, *extra):
    return ["--hf-checkpoint", str(files / "model"), "--rollout-batch-size", "1", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", *extra]  # fmt: skip


def test_prompt_data_flag_checks(files):
    args = parse_args(_argv(files, "--prompt-data", "train.jsonl@[0:1]", "--streaming-data", "--num-data-workers", "2"))
    assert args.prompt_data == "train.jsonl@[0:1]" and args.streaming_data and args.num_data_workers == 2
    with pytest.raises(SlimeArgumentError, match=r"--prompt-data train\.jsonl@\[0\]: malformed row slice"):
        parse_args(_argv(files, "--prompt-data", "train.jsonl@[0]"))
    with pytest.raises(SlimeArgumentError, match=r"--prompt-data nope\.jsonl: no such file"):
        parse_args(_argv(files, "--prompt-data", "nope.jsonl@[0:1]"))
    (files / "train.parquet").write_bytes(b"")
    with pytest.raises(SlimeArgumentError, match=r"--streaming-data reads JSONL .* convert it to JSONL"):
        parse_args(_argv(files, "--prompt-data", "train.parquet", "--streaming-data"))
    with pytest.raises(SlimeArgumentError, match=r"--num-data-workers 0: must be a positive number"):
        parse_args(_argv(files, "--prompt-data", "train.jsonl", "--num-data-workers", "0"))


# --- --num-data-workers --------------------------------------------------------------------------------


def _mixed_rows(n):
    """Plain prompts, chat messages (some with a system turn), tools, JSON-string metadata, some too long."""
    rows = []
    for i in range(n):
        if i % 3 == 0:
            prompt = [{"role": "user", "content": f"what comes after {i % 10}?"}]
            if i % 2:
                prompt.insert(0, {"role": "system", "content": "you are a helpful math tutor"})
        else:
            prompt = "what comes after " + " ".join(["one"] * (2 * (i % 13)))  # the longer ones exceed the limit
        row = {"prompt": prompt, "label": str(i), "meta": json.dumps({"i": i}) if i % 2 else {"i": i}}
        if i % 7 == 0:
            row["tools"] = [{"name": "calc"}]
        rows.append(row)
    return rows


def test_workers_give_the_same_samples_in_the_same_order(tmp_path, tokenizer, caplog):
    path = _write(tmp_path / "mixed.jsonl", _mixed_rows(300))
    kw = {"metadata_key": "meta", "tool_key": "tools", "apply_chat_template": True}
    with caplog.at_level(logging.WARNING):
        one = Dataset(path, tokenizer, None, 24, **KEYS, num_workers=1, **kw)
        two = Dataset(path, tokenizer, None, 24, **KEYS, num_workers=2, **kw)
    assert 0 < one.dropped < 300 and two.dropped == one.dropped
    assert [s.to_dict() for s in two] == [s.to_dict() for s in one]
    assert caplog.text.count(f"dropped {one.dropped} of 300 prompts longer than --rollout-max-prompt-len=24") == 2
    assert any(s.prompt.startswith("<|im_start|>system") for s in one)
    plain = Dataset(path, None, None, None, **KEYS, metadata_key="meta", num_workers=2)  # no tokenizer at all
    assert [s.prompt for s in plain] == [r["prompt"] for r in _mixed_rows(300)]


def test_worker_errors_name_file_line_and_key(tmp_path, tokenizer):
    rows = _mixed_rows(200)
    del rows[150]["label"]
    path = _write(tmp_path / "bad.jsonl", rows[:100] + [""] + rows[100:])
    with pytest.raises(ValueError, match=r"bad\.jsonl:152: missing key 'label' \(--label-key label\)"):
        Dataset(path, tokenizer, None, None, **KEYS, num_workers=2)


# --- data sources --------------------------------------------------------------------------------------


def _ds_args(tokenizer_dir, prompt_data, **kw):
    base = dict(
        hf_checkpoint=tokenizer_dir, prompt_data=prompt_data, input_key="prompt", label_key="label",
        metadata_key="meta", tool_key=None, apply_chat_template=False, apply_chat_template_kwargs=None,
        rollout_max_prompt_len=None, rollout_shuffle=False, rollout_seed=42, n_samples_per_prompt=2,
        save=None, load=None, buffer_filter_path=None, disable_rollout_global_dataset=False,
        rollout_global_dataset=True,
    )  # fmt: skip
    base.update(kw)
    return make_args(validate=False, **base)


def test_groups_indices_and_copies(tmp_path, tokenizer_dir):
    ds = RolloutDataSource(_ds_args(tokenizer_dir, _write(tmp_path / "d.jsonl", _rows(5)), n_samples_per_prompt=3))
    assert ds.dataset_size == 5
    groups = ds.get_samples(2)
    assert [[s.group_index for s in g] for g in groups] == [[0, 0, 0], [1, 1, 1]]
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [g[0].label for g in groups] == ["0", "1"]
    groups[0][0].metadata["i"] = 99  # deep copies: no aliasing between samples or with the dataset
    assert groups[0][1].metadata["i"] == 0 and ds.dataset[0].metadata["i"] == 0
    assert [g[0].group_index for g in ds.get_samples(1)] == [2]


def test_epoch_wrap_reshuffles_with_seed_plus_epoch(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "d.jsonl", _rows(5))
    ds = RolloutDataSource(_ds_args(tokenizer_dir, path, rollout_shuffle=True, rollout_seed=7, n_samples_per_prompt=1))
    reference = Dataset(path, None, None, None, **KEYS, seed=7)
    reference.shuffle(0)
    epoch0 = [s.label for s in reference]
    reference.shuffle(1)
    epoch1 = [s.label for s in reference]
    labels = [g[0].label for g in ds.get_samples(3)] + [g[0].label for g in ds.get_samples(4)]
    assert labels == epoch0[:3] + epoch0[3:] + epoch1[:2]
    assert (ds.epoch_id, ds.sample_offset) == (1, 2)
    # more groups than the dataset holds in one call: wraps as often as needed
    assert len(ds.get_samples(12)) == 12 and ds.epoch_id == 3


def test_save_load_resumes_the_same_prompts(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "d.jsonl", _rows(7))
    save = str(tmp_path / "ckpt")
    a = RolloutDataSource(_ds_args(tokenizer_dir, path, rollout_shuffle=True, save=save))
    a.get_samples(5)
    a.get_samples(4)  # crosses into epoch 1
    assert a.save(3) == os.path.join(save, "rollout", "data_source_state_3.json")
    expected = [[(s.label, s.group_index, s.index) for s in g] for g in a.get_samples(6)]

    b = RolloutDataSource(_ds_args(tokenizer_dir, path, rollout_shuffle=True, load=save))
    assert b.load(3) is True
    assert [[(s.label, s.group_index, s.index) for s in g] for g in b.get_samples(6)] == expected
    assert b.load(4) is False  # no state for that rollout: keeps going, with a warning
    assert RolloutDataSource(_ds_args(tokenizer_dir, path)).save(0) is None  # no --save: nothing written


def test_buffer_first_complete_groups_and_checkpoint(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "d.jsonl", _rows(6))
    save = str(tmp_path / "ckpt")
    ds = RolloutDataSourceWithBuffer(_ds_args(tokenizer_dir, path, save=save))
    first = ds.get_samples(3)
    with pytest.raises(
        ValueError, match="has 1 samples; the buffer takes only complete groups of --n-samples-per-prompt=2"
    ):
        ds.add_samples([first[0][:1]])
    first[2][0].response, first[2][0].status, first[2][0].reward = "partial", Sample.Status.ABORTED, {"score": 1.0}
    ds.add_samples([first[2], first[0]])
    assert ds.get_buffer_length() == 2
    ds.save(0)

    # FIFO from the buffer, then fresh groups from the dataset
    served = ds.get_samples(3)
    assert [g[0].group_index for g in served] == [2, 0, 3]
    assert served[0][0].response == "partial" and served[0][0].status == Sample.Status.ABORTED

    restored = RolloutDataSourceWithBuffer(_ds_args(tokenizer_dir, path, load=save))
    restored.load(0)
    again = restored.get_samples(3)
    assert [[s.to_dict() for s in g] for g in again] == [[s.to_dict() for s in g] for g in served]


def test_custom_buffer_filter(tmp_path, tokenizer_dir):
    path = _write(tmp_path / "d.jsonl", _rows(6))
    ds = RolloutDataSourceWithBuffer(_ds_args(tokenizer_dir, path, buffer_filter_path=f"{HERE}:lifo"))
    ds.add_samples(ds.get_samples(3))
    assert [g[0].group_index for g in ds.get_samples(2)] == [2, 1]
    assert [g[0].group_index for g in ds.get_samples(2)] == [0, 3]


def test_without_global_dataset(tmp_path, tokenizer_dir):
    ds = RolloutDataSource(_ds_args(tokenizer_dir, None))
    assert ds.dataset_size == 0
    groups = ds.get_samples(2)
    assert [[(s.prompt, s.index) for s in g] for g in groups] == [[("", 0), ("", 1)], [("", 2), ("", 3)]]
    with pytest.raises(RuntimeError, match="RolloutDataSourceWithBuffer"):
        ds.add_samples(groups)
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no prompts left"):
        RolloutDataSource(_ds_args(tokenizer_dir, empty))
