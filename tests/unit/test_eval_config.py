"""--eval-config (slime/utils/eval_config.py): YAML layout, defaults, errors naming file / dataset / key."""

from __future__ import annotations


import pytest

from slime.utils.eval_config import EvalConfigError, args_for, eval_datasets, load_eval_config
from tests.args import make_args


@pytest.fixture
def data(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"prompt": "say", "label": "one"}\n')
    return tmp_path


def write(tmp_path, text: str) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_merge_and_relative_paths(data):
    path = write(data, """
eval:
  defaults: {max_response_len: 16, temperature: 0.6}
  datasets:
    - {name: aime, path: a.jsonl, rm_type: math, n_samples_per_eval_prompt: 4, temperature: 0.0}
    - {name: gsm, path: b.jsonl, stop: "</answer>"}
""")
    aime, gsm = load_eval_config(path)
    assert aime == {"name": "aime", "path": str(data / "a.jsonl"), "rm_type": "math", "n_samples_per_eval_prompt": 4,
                    "temperature": 0.0, "max_response_len": 16}
    assert gsm["temperature"] == 0.6 and gsm["max_response_len"] == 16
    ns = args_for(make_args(validate=False, eval_temperature=None, rollout_stop=None, eval_max_response_len=None), gsm)
    assert (ns.eval_temperature, ns.eval_max_response_len, ns.rollout_stop) == (0.6, 16, ["</answer>"])


def test_without_the_eval_wrapper(data):
    assert [d["name"] for d in load_eval_config(write(data, "datasets:\n  - {name: x, path: a.jsonl}\n"))] == ["x"]


@pytest.mark.parametrize("body, message", [
    ("datasets:\n  - {name: x, path: a.jsonl, temprature: 1}\n", r"datasets\[0\] \(x\): unknown key\(s\) \['temprature'\]"),
    ("datasets:\n  - {name: x}\n", r"datasets\[0\] \(x\): `path` is required"),
    ("datasets:\n  - {name: x, path: nope.jsonl}\n", r"path 'nope.jsonl': no such file"),
    ("datasets:\n  - {name: x, path: a.jsonl, n_samples_per_eval_prompt: two}\n", "should be int"),
    ("datasets:\n  - {name: x, path: a.jsonl, rm_type: 3}\n", r"datasets\[0\] \(x\): `rm_type: 3` should be a str"),
    ("datasets:\n  - {name: x, path: a.jsonl}\n  - {name: x, path: b.jsonl}\n", r"\['x'\] used more than once"),
    ("eval: {sets: []}\n", "expected `datasets:`"),
])  # fmt: skip
def test_errors_name_the_file_dataset_and_key(data, body, message):
    path = write(data, body)
    with pytest.raises(EvalConfigError, match=message) as e:
        load_eval_config(path)
    assert path in str(e.value)


def test_eval_prompt_data_pairs_without_a_config():
    args = make_args(validate=False, eval_datasets=None, eval_prompt_data=["aime", "/a", "gsm", "/b"])
    assert eval_datasets(args) == [{"name": "aime", "path": "/a"}, {"name": "gsm", "path": "/b"}]



def test_sliced_eval_paths_are_accepted_and_malformed_ones_named(data):
    ok = write(data, "eval:\n  datasets:\n    - name: aime\n      path: a.jsonl@[:1]\n")
    assert load_eval_config(ok)[0]["path"] == str(data / "a.jsonl") + "@[:1]"
    bad = write(data, "eval:\n  datasets:\n    - name: aime\n      path: a.jsonl@[x]\n")
    with pytest.raises(EvalConfigError, match=r"datasets\[0\].*malformed row slice"):
        load_eval_config(bad)
