"""tools/check_launch_script.py on launch scripts written like slime's: the stubs record the train.py command
line (nothing is started), which is then parsed and validated; one status per script."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from tools.check_launch_script import check_argv, check_script, format_result, main

HEAD = """\
#!/bin/bash
pkill -9 sglang
sleep 3
ray stop --force
pkill -9 python
set -ex
NUM_GPUS=$(nvidia-smi -L | wc -l)
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "%(models)s/qwen3-4B.sh"
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus ${NUM_GPUS} --disable-usage-stats
"""
TRAIN = """\
ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{"env_vars": {}}' \\
   -- python3 %(entry)s \\
   --actor-num-nodes 1 --actor-num-gpus-per-node ${NUM_GPUS} --colocate \\
   ${MODEL_ARGS[@]} \\
   --hf-checkpoint /nowhere/Qwen3-4B --ref-load /nowhere/Qwen3-4B_torch_dist \\
   --prompt-data /nowhere/dapo.jsonl --input-key prompt --label-key label --apply-chat-template --rm-type math \\
   --num-rollout 10 --rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256 \\
   --tensor-model-parallel-size 2 --bf16 --sglang-mem-fraction-static 0.7 %(extra)s
"""
MODELS = os.path.join(REPO_ROOT, "scripts", "models")


def write(path, extra: str = "", entry: str = "train.py", before_train: str = "", models: str = MODELS) -> str:
    path.write_text(HEAD % {"models": models} + before_train + TRAIN % {"entry": entry, "extra": extra})
    return str(path)


def test_a_valid_script_is_ok_with_stand_ins_for_paths_missing_here(tmp_path):
    result = check_script(write(tmp_path / "run.sh"), cwd=str(tmp_path), gpus=4)
    assert result.status == "OK", result.detail
    assert result.entry == "train.py"
    # the stub nvidia-smi listed 4 GPUs: the script's own detection fed them to the command line
    assert result.argv[result.argv.index("--actor-num-gpus-per-node") + 1] == "4"
    assert result.argv[-2:] == ["--sglang-mem-fraction-static", "0.7"]
    assert result.stand_ins == ["--hf-checkpoint /nowhere/Qwen3-4B", "--ref-load /nowhere/Qwen3-4B_torch_dist",
                                "--prompt-data /nowhere/dapo.jsonl"]  # fmt: skip
    assert "stand-ins for paths missing here: --hf-checkpoint /nowhere/Qwen3-4B" in format_result(result)


def test_strict_paths_refuse_the_missing_checkpoint(tmp_path):
    result = check_script(write(tmp_path / "run.sh"), cwd=str(tmp_path), strict_paths=True)
    assert result.status == "REFUSED" and result.detail.startswith("--ref-load /nowhere/Qwen3-4B_torch_dist: no such")


@pytest.mark.parametrize("extra, status, detail", [
    ("--moe-enable-deepep", "REFUSED", "--moe-enable-deepep: not supported here: DeepEP"),
    ("--no-such-flag 3", "PARSE ERROR", "unknown flag(s): --no-such-flag"),
    ("--rollout-batch-size many", "PARSE ERROR", "argument --rollout-batch-size: invalid int value: 'many'"),
])  # fmt: skip
def test_refusals_and_parse_errors_say_why(tmp_path, extra, status, detail):
    result = check_script(write(tmp_path / "run.sh", extra), cwd=str(tmp_path))
    assert (result.status, result.detail[: len(detail)]) == (status, detail)


def test_a_script_that_stops_before_train_py(tmp_path):
    script = write(tmp_path / "run.sh", before_train='[ -n "$NEVER_SET" ] || { echo "NEVER_SET is not set"; exit 1; }\n')
    result = check_script(script, cwd=str(tmp_path))
    assert result.status == "NO TRAIN LINE" and "exit 1: " in result.detail and "NEVER_SET is not set" in result.detail
    assert check_script(script, cwd=str(tmp_path), env={"NEVER_SET": "1"}).status == "OK"


def test_train_async_gets_its_own_checks(tmp_path):
    result = check_script(write(tmp_path / "run.sh", entry="train_async.py"), cwd=str(tmp_path))
    assert result.entry == "train_async.py" and result.status == "REFUSED"
    assert "--colocate" in result.detail  # train_async.py generates while training: no colocated engines


def test_a_script_expecting_to_be_copied_is_run_as_a_copy(tmp_path):
    """slime's scripts/low_precision/* source `${SCRIPT_DIR}/../scripts/models/...` (a copy one folder below the
    checkout's root); the tool runs such a script from a mirror of the checkout, writing nothing into it."""
    checkout = tmp_path / "slime"
    (checkout / "scripts" / "low_precision").mkdir(parents=True)
    os.symlink(MODELS, checkout / "scripts" / "models")
    script = write(checkout / "scripts" / "low_precision" / "run-fp8.sh", models="${SCRIPT_DIR}/../scripts/models")
    result = check_script(script, cwd=str(checkout))
    assert result.status == "OK", result.detail
    assert result.note == f"run as a copy in a folder of {checkout} (where its `source` lines expect it)"
    assert sorted(os.listdir(checkout)) == ["scripts"]


def test_all_prints_a_table_and_counts(tmp_path, capsys):
    checkout = tmp_path / "slime"
    (checkout / "scripts").mkdir(parents=True)
    os.symlink(MODELS, checkout / "scripts" / "models")
    write(checkout / "scripts" / "run-a.sh")
    write(checkout / "scripts" / "run-b.sh", "--use-opd")
    assert main(["--all", str(checkout)]) == 1  # not all OK
    out = capsys.readouterr().out
    assert "scripts/run-a.sh: OK (train.py)" in out and "scripts/run-b.sh: REFUSED (train.py)" in out
    assert out.rstrip().endswith("2 script(s): 1 OK, 1 REFUSED, 0 PARSE ERROR, 0 NO TRAIN LINE")


def test_check_argv_alone(tmp_path):
    assert check_argv(["--no-such-flag"])[0] == "PARSE ERROR"
    status, detail, _ = check_argv(["--rollout-batch-size", "2", "--num-rollout", "1", "--prompt-data", "/x.jsonl",
                                    "--rollout-num-gpus", "8"])
    assert status == "REFUSED" and "--hf-checkpoint is required" in detail, textwrap.shorten(detail, 200)


PLUGIN = "async def generate(args, sample, sampling_params):\n    return sample\n"


@pytest.mark.parametrize("how", ["runtime-env", "export"])
def test_plugins_import_from_the_pythonpath_the_script_gives_train_py(tmp_path, how):
    """slime's search-r1, retool and tau-bench scripts put their own folder on PYTHONPATH through `ray job submit
    --runtime-env-json '{"env_vars": {"PYTHONPATH": ...}}'` and name their plugin by module (`generate_with_x.generate`);
    a script may also `export PYTHONPATH=`. The plugin is resolved with that PYTHONPATH, as train.py would."""
    plugins = tmp_path / "example"
    plugins.mkdir()
    (plugins / f"generate_with_tool_{how.replace('-', '_')}.py").write_text(PLUGIN)
    module = f"generate_with_tool_{how.replace('-', '_')}"
    extra = f"--custom-generate-function-path {module}.generate"
    if how == "runtime-env":
        env_json = '{\\"env_vars\\": {\\"PYTHONPATH\\": \\"/root/Megatron-LM/:${SCRIPT_DIR}/example\\"}}'
        before_train = f'RUNTIME_ENV_JSON="{env_json}"\n'
        script = (HEAD % {"models": MODELS} + before_train
                  + TRAIN.replace("--runtime-env-json='{\"env_vars\": {}}'", '--runtime-env-json="${RUNTIME_ENV_JSON}"')
                  % {"entry": "train.py", "extra": extra})
    else:
        script = (HEAD % {"models": MODELS} + 'export PYTHONPATH="${SCRIPT_DIR}/example:${PYTHONPATH}"\n'
                  + TRAIN % {"entry": "train.py", "extra": extra})
    (tmp_path / "run.sh").write_text(script)
    result = check_script(str(tmp_path / "run.sh"), cwd=str(tmp_path))
    assert result.status == "OK", result.detail
    assert str(plugins) in result.pythonpath.split(os.pathsep)
    assert module not in sys.modules and str(plugins) not in sys.path  # the checker's own process is left as it was
    # without the PYTHONPATH entry the same line is refused, naming the module
    status, detail, _ = check_argv(result.argv, result.entry)
    assert status == "REFUSED" and f"cannot import '{module}'" in detail
