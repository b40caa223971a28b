"""The engine HTTP contract suite (tests/contract) against a real SGLang server on this GPU (run on the H200).

The server is started here on the tiny Qwen3 with the flags the suite's docstring asks for (`--enable-memory-saver`
for the release/resume tests, bf16) and the triton attention backend / pytorch sampler that run on the H200, without
CUDA graphs (quick to start; nothing here measures speed), and slime's server environment. The suite runs in its own
pytest process against it (`--engine-same-host` for the CUDA-IPC tensor path, `--weight-sync-backend gloo` since
NCCL refuses two ranks on one GPU, `--logprob-tol 0.05` for bf16). It must pass whole, the distributed weight
update included (SGLang keys the group's store under the group name; slime/weight_sync/group.py does too); the
pickle test may end as its expected failure (SGLang 0.5.16 refuses the payload, then its scheduler dies).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.gpu.sglang_runs import kept_log, sglang_server
from tests.gpu.test_sglang_train import sglang_startable

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not sglang_startable(), reason="needs sglang importable, or SLIME_SGLANG_LAUNCHER"),
]
SERVER_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--dtype", "bfloat16",
                "--mem-fraction-static", "0.3", "--enable-memory-saver", "--disable-cuda-graph", "--random-seed", "0"]


def run_contract(url: str, tmp_path, tag: str, *paths: str) -> tuple[int, str, str, list[tuple[str, str]]]:
    """The contract suite's `paths` in their own pytest process against the server at `url`: (its exit status, its
    output, its summary line, (outcome, test) of each test), and a line `[tag] summary; not passed: ...`. Its output
    is written as it runs to `kept_log` (`<tag>.log`), so a run stopped from outside still says how far it got."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    log_path = kept_log(tmp_path, re.sub(r"\W+", "-", tag) + ".log")
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *paths, "-rA", "-p", "no:cacheprovider", "--engine-url", url,
             "--engine-same-host", "--weight-sync-backend", "gloo", "--logprob-tol", "0.05",
             "--basetemp", str(tmp_path / "contract")],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    with open(log_path, errors="replace") as log:
        said = log.read()
    summary = (re.findall(r"^=+ (.+ in [\d.]+s.*?) =+$", said, re.M) or ["(no pytest summary)"])[-1]
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*?::(\w+)", said, re.M)
    print(f"\n[{tag}] {summary}; not passed: {[f'{o} {t}' for o, t in outcomes if o != 'PASSED'] or 'none'}")
    return done.returncode, said, summary, outcomes


@pytest.mark.timeout(900)
def test_contract_suite_against_real_sglang(tiny_model_dir, tmp_path):
    with sglang_server(tiny_model_dir, kept_log(tmp_path, "sglang-contract.log"), *SERVER_FLAGS) as url:
        rc, said, _, outcomes = run_contract(url, tmp_path, "contract vs sglang", "tests/contract")
    assert rc == 0, said[-6000:]
    assert ("PASSED", "test_update_weights_from_distributed") in outcomes, said[-4000:]
