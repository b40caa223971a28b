"""slime.utils.external_utils (slime's launcher helpers for Python launch scripts): `execute_train` run with the
commands that would start things replaced by tools/check_launch_script.py's recording stubs; the train.py line
it submits is then checked by our parser. `dataclass_cli` through typer's test runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from slime.utils.external_utils import command_utils as U
from slime.utils.external_utils.typer_utils import dataclass_cli
from tests.conftest import REPO_ROOT
from tools.check_launch_script import check_argv, make_stubs

TRAIN_ARGS = ("--hf-checkpoint /nowhere/Qwen3-4B --prompt-data /nowhere/p.jsonl --input-key prompt "
              "--rm-type math --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 32 "
              "--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4")  # fmt: skip


def _execute_train(tmp_path, model_type: str | None, **env) -> tuple[list[dict], str]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    make_stubs(str(stubs))
    record = tmp_path / "calls.jsonl"
    code = ("from slime.utils.external_utils.command_utils import execute_train, ExecuteTrainConfig; "
            f"execute_train({TRAIN_ARGS!r}, 4, {model_type!r}, extra_env_vars={{'A': '1'}}, "
            "config=ExecuteTrainConfig(extra_env_vars='B=2 C=3'))")  # fmt: skip
    full_env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", SLIME_CHECK_RECORD=str(record),
                    SLIME_CHECK_GPUS="4", PYTHONPATH=REPO_ROOT, **env)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return calls, out.stdout


@pytest.mark.parametrize("model_type", [None, "qwen3-4B"])
def test_execute_train_submits_a_train_line_our_parser_accepts(tmp_path, model_type):
    calls, printed = _execute_train(tmp_path, model_type)
    assert [c["entry"] for c in calls] == ["train.py"]
    argv = calls[0]["argv"]
    if model_type:  # the model file's MODEL_ARGS come first, as slime's launcher puts them
        assert "--num-layers" in argv[: argv.index("--hf-checkpoint")]
    assert argv[argv.index("--hf-checkpoint"):] == TRAIN_ARGS.split()
    assert calls[0]["pythonpath"].split(os.pathsep)[0] == REPO_ROOT  # this checkout's slime and examples
    assert "EXEC: ray stop --force" in printed and "ray start --head --node-ip-address 127.0.0.1 --num-gpus 4" in printed
    submitted = next(line for line in printed.splitlines() if "ray job submit" in line)
    env_vars = json.loads(submitted.split("--runtime-env-json=", 1)[1].split(" -- python3", 1)[0].strip("'"))["env_vars"]
    assert {k: env_vars[k] for k in ("A", "B", "C", "NCCL_NVLS_ENABLE", "MASTER_ADDR")} == {
        "A": "1", "B": "2", "C": "3", "NCCL_NVLS_ENABLE": "0", "MASTER_ADDR": "127.0.0.1"}  # the stub GPUs: no NVLink
    status, detail, _ = check_argv(argv, calls[0]["entry"], pythonpath=calls[0]["pythonpath"])
    assert status == "OK", detail


def test_execute_train_with_external_ray_and_no_submit_starts_nothing(tmp_path):
    calls, printed = _execute_train(tmp_path, None, SLIME_SCRIPT_EXTERNAL_RAY="1", SLIME_SCRIPT_ENABLE_RAY_SUBMIT="0")
    assert calls == [] and "ray stop" not in printed and "ray start" not in printed


def test_small_helpers(monkeypatch, tmp_path):
    for value, expected in [("TRUE", True), ("1", True), ("0", False), ("false", False), ("yes", False)]:
        monkeypatch.setenv("SLIME_X", value)
        assert U.get_bool_env_var("SLIME_X") is expected
    monkeypatch.delenv("SLIME_X")
    assert U.get_bool_env_var("SLIME_X", "true") is True
    assert U.parse_extra_env_vars('{"A": "1"}') == {"A": "1"} and U.parse_extra_env_vars(" A=1  B=x=y ") == {
        "A": "1", "B": "x=y"}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert U.get_default_wandb_args("tests/test_qwen3_4B.py") == ""
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.delenv("GITHUB_COMMIT_NAME", raising=False)
    flags = U.get_default_wandb_args("tests/a.py", run_name_prefix="p", run_id="r1")  # a short name takes its folder's
    assert flags == ("--use-wandb --wandb-project slime-tests_a --wandb-group p_r1 --wandb-key 'k' "
                     "--disable-wandb-random-suffix ")  # fmt: skip
    assert len(U.create_run_id().split("-")) == 3
    assert U.exec_command("echo hi", capture_output=True) == "hi\n"
    with pytest.raises(subprocess.CalledProcessError):
        U.exec_command("exit 3")
    with pytest.raises(NotImplementedError, match="no tools/fp8_cast_bf16.py"):
        U.fp8_cast_bf16("/a", "/b")
    assert U.repo_base_dir.samefile(REPO_ROOT)


@dataclass
class Demo:
    name: str
    count: int = 1


def test_dataclass_cli_reads_options_and_environment(monkeypatch):
    seen = []
    app = typer.Typer()

    @app.command()
    @dataclass_cli
    def main(config: Demo):
        seen.append(config)

    runner = CliRunner()
    assert runner.invoke(app, ["--name", "a", "--count", "3"]).exit_code == 0
    monkeypatch.setenv("SLIME_SCRIPT_NAME", "from-env")
    assert runner.invoke(app, []).exit_code == 0
    assert seen == [Demo("a", 3), Demo("from-env", 1)]
    assert runner.invoke(app, ["--count", "x"]).exit_code != 0  # typer checks the field's type
