"""Eval datasets (slime/utils/eval_config.py): YAML layout, resolution entry > defaults > flags, errors naming
file / dataset / key, and what parse_args makes of them."""

from __future__ import annotations

import pytest

from slime.config.arguments import SlimeArgumentError
from slime.utils.eval_config import (
    EvalConfigError,
    EvalDatasetConfig,
    args_for,
    build_eval_dataset_configs,
    ensure_dataset_list,
    eval_datasets,
    load_eval_config,
    resolve_eval_datasets,
)
from tests.args import make_args


@pytest.fixture
def data(tmp_path, monkeypatch):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"prompt": "say", "label": "one"}\n')
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # the data files are not in the working directory
    return tmp_path


def write(tmp_path, text: str) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def _args(**fields):
    return make_args(validate=False, **fields)


def test_entry_then_defaults_then_flags(data):
    path = write(data, """
eval:
  defaults: {max_response_len: 16, temperature: 0.6, repetition_penalty: 1.1}
  datasets:
    - {name: aime, path: a.jsonl, rm_type: math, n_samples_per_eval_prompt: 4, temperature: 0.0}
    - {name: gsm, path: b.jsonl, stop: "</answer>", metadata_overrides: {level: hard}}
""")
    args = _args(eval_config=path, eval_temperature=None, eval_top_p=0.9, rollout_top_p=0.5, rollout_stop=["</s>"],
                 eval_max_response_len=None, n_samples_per_eval_prompt=2)
    aime, gsm = resolve_eval_datasets(args)
    assert isinstance(aime, EvalDatasetConfig) and aime.path == str(data / "a.jsonl")  # from the YAML's folder
    assert (aime.temperature, gsm.temperature) == (0.0, 0.6)  # entry, else defaults
    assert (aime.top_p, aime.stop, gsm.stop) == (0.9, ["</s>"], ["</answer>"])  # --eval-top-p before --rollout-top-p
    assert (aime.n_samples_per_eval_prompt, gsm.n_samples_per_eval_prompt) == (4, 2)
    assert gsm.repetition_penalty == 1.1 and gsm.rm_type is None  # defaults reach fields without flags too
    assert gsm.inject_metadata({"i": 1}) == {"i": 1, "level": "hard"}
    assert aime.inject_metadata(None) == {"rm_type": "math"}

    ns = args_for(args, gsm)
    assert (ns.eval_temperature, ns.eval_max_response_len, ns.rollout_stop) == (0.6, 16, ["</answer>"])
    assert args.eval_temperature is None  # args itself is not touched


def test_dataset_mapping_form_and_a_path_from_the_working_directory(data, monkeypatch):
    monkeypatch.chdir(data)
    (data / "sub" / "a.jsonl").write_text('{"prompt": "other"}\n')  # same relative name next to the YAML
    path = write(data / "sub", "datasets:\n  aime: {path: a.jsonl}\n  gsm: {path: b.jsonl}\n")
    aime, gsm = resolve_eval_datasets(_args(eval_config=path))
    assert (aime.name, aime.path, gsm.path) == ("aime", "a.jsonl", "b.jsonl")  # found from the cwd: kept as given
    assert ensure_dataset_list(None) == []


def test_eval_prompt_data_pairs_and_the_lone_path(data):
    first, second = eval_datasets(_args(eval_prompt_data=["x", str(data / "a.jsonl"), "y", str(data / "b.jsonl")]))
    assert (first.name, second.name, second.path) == ("x", "y", str(data / "b.jsonl"))
    assert [d.name for d in eval_datasets(_args(eval_prompt_data=[str(data / "a.jsonl")]))] == ["aime"]
    assert eval_datasets(_args()) == []
    with pytest.raises(EvalConfigError, match="expected name path pairs"):
        eval_datasets(_args(eval_prompt_data=["x", "a", "y"]))


@pytest.mark.parametrize("body, message", [
    ("datasets:\n  - {name: x, path: a.jsonl, temprature: 1}\n", r"datasets\[0\] \(x\): unknown key\(s\) \['temprature'\]"),
    ("defaults: {temprature: 1}\ndatasets:\n  - {name: x, path: a.jsonl}\n", r"eval.defaults: \['temprature'\]"),
    ("datasets:\n  - {name: x}\n", r"datasets\[0\] \(x\): `path` is required"),
    ("datasets:\n  - {path: a.jsonl}\n", r"datasets\[0\]: each eval dataset needs a `name`"),
    ("datasets:\n  - {name: x, path: nope.jsonl}\n", r"path 'nope.jsonl': no such file"),
    ("datasets:\n  - {name: x, path: a.jsonl, n_samples_per_eval_prompt: two}\n", "should be int"),
    ("datasets:\n  - {name: x, path: a.jsonl, rm_type: 3}\n", r"datasets\[0\] \(x\): `rm_type: 3` should be str"),
    ("datasets:\n  - {name: x, path: a.jsonl, min_eval_samples: 0}\n", "min_eval_samples must be positive"),
    ("datasets:\n  - {name: x, path: a.jsonl}\n  - {name: x, path: b.jsonl}\n", r"\['x'\] used more than once"),
    ("eval: {sets: []}\n", "expected `datasets:`"),
    ("datasets:\n  - name: x\n    path: a.jsonl@[x]\n", r"datasets\[0\].*malformed row slice"),
    ("datasets: [{name: x\n", "not valid YAML"),
])  # fmt: skip
def test_errors_name_the_file_dataset_and_key(data, body, message):
    path = write(data, body)
    with pytest.raises(EvalConfigError, match=message) as e:
        resolve_eval_datasets(_args(eval_config=path))
    assert path in str(e.value)


def test_sliced_paths_and_entries_resolve_without_a_file(data):
    path = write(data, "eval:\n  datasets:\n    - name: aime\n      path: a.jsonl@[:1]\n")
    assert load_eval_config(path)[0][0]["path"] == str(data / "a.jsonl") + "@[:1]"
    # slime's contract: plain namespaces work too (unset attributes are "not set")
    (ds,) = build_eval_dataset_configs(object(), [{"name": "x", "path": "/d.jsonl", "stop": "</a>"}], None)
    assert ds.stop == ["</a>"] and ds.temperature is None and ds.cache_key == ("x", "/d.jsonl", None, None, None, None)


def _argv(*extra):
    return ["--hf-checkpoint", "model", "--rollout-batch-size", "1", "--num-rollout", "1", "--prompt-data",
            "train.jsonl", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", *extra]  # fmt: skip


def test_eval_datasets_with_images(files):
    """An eval dataset reads images with --multimodal-keys (or its own multimodal_keys in a run with images);
    a dataset's multimodal_keys in a run without images, or a media type other than image, is refused."""
    from slime.config.arguments import parse_args

    images = ("--multimodal-keys", '{"image": "images"}', "--rollout-backend", "hf")
    args = parse_args(_argv(*images, "--eval-prompt-data", "toy", "train.jsonl"))
    assert [(d.name, d.multimodal_keys) for d in args.eval_datasets] == [("toy", {"image": "images"})]
    (files / "own.yaml").write_text("datasets:\n  - {name: toy, path: train.jsonl, multimodal_keys: {image: img}}\n")
    args = parse_args(_argv(*images, "--eval-config", "own.yaml"))
    assert args.eval_datasets[0].multimodal_keys == {"image": "img"}  # the dataset's own key over the flag's
    with pytest.raises(SlimeArgumentError, match=r"datasets\[0\] \(toy\): multimodal_keys: \{\"image\": \"img\"\} in "
                                                 r"a run without --multimodal-keys"):
        parse_args(_argv("--eval-config", "own.yaml"))
    (files / "video.yaml").write_text("datasets:\n  - {name: toy, path: train.jsonl, multimodal_keys: {video: v}}\n")
    with pytest.raises(SlimeArgumentError, match=r"media types \['video'\]: images only"):
        parse_args(_argv(*images, "--eval-config", "video.yaml"))


def test_parse_args_resolves_and_checks_the_datasets(files):
    from slime.config.arguments import parse_args

    (files / "eval.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, top_p: 0.7}\n")
    args = parse_args(_argv("--eval-config", "eval.yaml", "--eval-interval", "5"))
    assert [(d.name, d.top_p, d.temperature) for d in args.eval_datasets] == [("aime", 0.7, 1.0)]
    assert args.eval_prompt_data == ["aime", "train.jsonl"]  # found from the working directory: kept as given

    (files / "app.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, app_service: http://x}\n")
    with pytest.raises(SlimeArgumentError, match=r"datasets\[0\] \(aime\): app_service: 'http://x': the built-in "
                                                 r"eval rollout .* does not act on this setting"):
        parse_args(_argv("--eval-config", "app.yaml"))
    # sent with the eval requests (sglang_rollout.eval_sampling_params), but the hf engine (the CPU default)
    # does not implement them: refused up front, naming the engine; the "off" values pass
    (files / "pen.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, repetition_penalty: 1.2}\n")
    with pytest.raises(SlimeArgumentError, match=r"datasets\[0\] \(aime\): repetition_penalty: 1.2: the hf engine "
                                                 r"\(--rollout-backend hf\) does not implement this sampling setting"):
        parse_args(_argv("--eval-config", "pen.yaml"))
    with pytest.raises(SlimeArgumentError, match=r"min_new_tokens: 4: the hf engine"):
        parse_args(_argv("--eval-config", "eval.yaml", "--eval-min-new-tokens", "4"))
    (files / "off.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, repetition_penalty: 1.0, "
                                    "min_new_tokens: 0, no_stop_trim: false}\n")
    (off,) = parse_args(_argv("--eval-config", "off.yaml")).eval_datasets
    assert (off.repetition_penalty, off.min_new_tokens, off.no_stop_trim) == (1.0, 0, False)

    (files / "hook.yaml").write_text("datasets:\n  - {name: aime, path: train.jsonl, custom_rm_path: my_rm.nope}\n")
    (files / "my_rm.py").write_text("async def score(args, sample):\n    return 1.0\n")
    with pytest.raises(SlimeArgumentError, match=r"datasets\[0\] \(aime\): custom_rm_path: .*has no attribute 'nope'"):
        parse_args(_argv("--eval-config", "hook.yaml"))
