"""SFT and on-policy distillation on one GPU, with the CPU examples' command lines (run on the H200).

- SFT (examples/sft/run-cpu.sh, slime's SFT flags) with `--train-backend megatron` (bf16) and `fsdp`: the loss
  halves within 20 steps, as on CPU.
- OPD, `--opd-type sglang` against a real SGLang server of the teacher (started here through
  `SLIME_SGLANG_LAUNCHER`, docs/sglang_backend.md; TEACHER_URL of examples/on_policy_distillation/run-cpu.sh),
  the student colocated with its `hf` engine on the same GPU, megatron and fsdp trainers; and `--opd-type
  megatron` (the Megatron trainer holds the teacher): every step has a gradient, the student-teacher KL falls, and
  the teacher log-probs of the first rollout are the teacher's (a transformers forward, to SGLang's bf16 error).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import time

import httpx
import pytest
import torch

from slime.utils.net import free_port
from slime.utils.tracking import read_scalars
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.test_opd import ROLLOUTS, check_kl_falls, teacher_dir  # noqa: F401 (a fixture)
from tests.e2e_cpu.test_sft import sft_data  # noqa: F401 (a fixture)
from tests.e2e_cpu.test_train_e2e import _env

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]
SFT = os.path.join(REPO_ROOT, "examples", "sft", "run-cpu.sh")
OPD = os.path.join(REPO_ROOT, "examples", "on_policy_distillation", "run-cpu.sh")


def run_script(script: str, tmp_path, name: str, env: dict, *extra: str) -> str:
    tb, dump = str(tmp_path / name / "tb"), str(tmp_path / name / "train_{rollout_id}_{rank}.pt")
    env = dict(_env(), NUM_ROLLOUT=str(ROLLOUTS), SLIME_ENGINE_LOG_DIR=str(tmp_path / name / "engine_logs"), **env,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    start = time.time()
    done = subprocess.run(["bash", script, "--tensorboard-dir", tb, "--save-debug-train-data", dump, *extra],
                          capture_output=True, text=True, env=env, timeout=500, cwd=str(tmp_path))
    assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    print(f"\n[{name}] {time.time() - start:.1f} s")
    return tb


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_sft_loss_halves_on_gpu(backend, tiny_model_dir, sft_data, tmp_path):  # noqa: F811
    tb = run_script(SFT, tmp_path, f"sft_{backend}", {"MODEL_DIR": tiny_model_dir, "DATA": sft_data},
                    "--train-backend", backend)
    loss = read_scalars(tb, "train/loss")
    print(f"[sft {backend}] loss:", {k: round(v, 3) for k, v in loss.items()})
    assert sorted(loss) == list(range(24)) and loss[0] > 4.0 and loss[19] <= loss[0] / 2, loss


@pytest.fixture(scope="module")
def sglang_teacher(teacher_dir, tmp_path_factory):  # noqa: F811
    """A real SGLang server of the teacher on this GPU (a small static pool, no CUDA graphs: quick to start)."""
    launcher = os.environ.get("SLIME_SGLANG_LAUNCHER", "python3 -m sglang.launch_server")
    if launcher.startswith("python3 -m") and importlib.util.find_spec("sglang") is None:
        pytest.skip("needs sglang importable, or SLIME_SGLANG_LAUNCHER")
    port = free_port()
    log = open(tmp_path_factory.mktemp("teacher") / "sglang_teacher.log", "w")
    cmd = [*shlex.split(launcher), "--model-path", teacher_dir, "--host", "127.0.0.1", "--port", str(port),
           "--attention-backend", "triton", "--sampling-backend", "pytorch", "--dtype", "bfloat16",
           "--mem-fraction-static", "0.15", "--disable-cuda-graph", "--random-seed", "0"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, start = f"http://127.0.0.1:{port}", time.time()
    try:
        while time.time() - start < 300:
            assert proc.poll() is None, open(log.name).read()[-4000:]
            try:
                if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"the SGLang teacher did not answer in 300 s: {open(log.name).read()[-3000:]}")
        print(f"\n[teacher] SGLang up in {time.time() - start:.1f} s")
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def check_student_trains(tb: str, name: str) -> None:
    """Every step had a gradient: 0 means none reached the optimizer (as when the colocated offload cut megatron-core
    DDP's gradient hooks off the parameters: the KL then stays flat while the teacher's log-probs are right)."""
    grad_norm = read_scalars(tb, "train/grad_norm")
    print(f"[{name}] grad_norm:", {k: round(v, 4) for k, v in grad_norm.items()})
    assert sorted(grad_norm) == list(range(ROLLOUTS)) and min(grad_norm.values()) > 0, grad_norm


def check_teacher_log_probs(tmp_path, name: str, teacher: str) -> None:
    from tests.e2e_cpu.test_megatron_actor import hf_log_probs

    rows = torch.load(str(tmp_path / name / "train_0_0.pt"), weights_only=False)["samples"]
    batch = {"tokens": [r["tokens"].tolist() for r in rows], "response_lengths": [r["response_lengths"] for r in rows]}
    diffs = [abs(a - b) for row, want in zip(rows, hf_log_probs(teacher, batch))
             for a, b in zip(row["teacher_log_probs"].tolist(), want)]
    mean = sum(diffs) / len(diffs)
    print(f"[{name}] teacher log-probs vs a transformers fp32 forward of the teacher: mean |diff| {mean:.2e}, "
          f"max {max(diffs):.2e}")
    # bf16 of this sharp teacher (|log-prob| ~10): transformers' own bf16 forward is 0.03 mean / 0.12 max off fp32
    assert mean < 0.1 and max(diffs) < 0.5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_opd_sglang_teacher_on_gpu(backend, sglang_teacher, tiny_model_dir, teacher_dir, toy_data_path,  # noqa: F811
                                   tmp_path):
    name = f"opd_sglang_{backend}"
    tb = run_script(OPD, tmp_path, name, {"OPD_TYPE": "sglang", "TEACHER_URL": sglang_teacher,
                                          "MODEL_DIR": tiny_model_dir, "TEACHER_DIR": teacher_dir,
                                          "DATA": toy_data_path},
                    "--colocate", "--rollout-backend", "hf", "--train-backend", backend)
    check_student_trains(tb, name)
    check_kl_falls(tb)
    assert set(read_scalars(tb, "rollout/raw_reward").values()) == {0.0}
    check_teacher_log_probs(tmp_path, name, teacher_dir)  # SGLang's bf16 teacher: its log-probs


@pytest.mark.timeout(600)
def test_opd_megatron_type_on_gpu(tiny_model_dir, teacher_dir, toy_data_path, tmp_path):  # noqa: F811
    name = "opd_megatron_type"
    tb = run_script(OPD, tmp_path, name, {"OPD_TYPE": "megatron", "MODEL_DIR": tiny_model_dir,
                                          "TEACHER_DIR": teacher_dir, "DATA": toy_data_path},
                    "--colocate", "--rollout-backend", "hf", "--train-backend", "megatron")
    check_student_trains(tb, name)
    check_kl_falls(tb)
    check_teacher_log_probs(tmp_path, name, teacher_dir)  # the bf16 Megatron teacher
