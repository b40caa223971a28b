"""The multi-turn examples end to end on CPU: examples/search-r1/run-cpu.sh (a real BM25 retrieval server
process, train.py with Ray, sglang-router, an hf engine and fsdp) and examples/tool_calculator/run-cpu.sh,
one rollout each; plus the examples' pure parts (reward, calculator, retrieval ranking)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time

import psutil
import pytest
import torch

from slime.utils.net import free_port
from tests.conftest import REPO_ROOT
from tests.e2e_cpu.leaks import run_processes, wait_for_no_new_processes

SEARCH_R1 = os.path.join(REPO_ROOT, "examples", "search-r1")
CALCULATOR = os.path.join(REPO_ROOT, "examples", "tool_calculator")
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--micro-batch-size", "4"]


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _env(**extra) -> dict:
    return dict(os.environ, SLIME_TRAIN_NUM_THREADS="1", SLIME_ENGINE_NUM_THREADS="1", OMP_NUM_THREADS="1",
                PYTHONPATH=REPO_ROOT, **extra)


def _samples(path) -> list[dict]:
    return torch.load(path, weights_only=False)["samples"]


# --- pure parts ------------------------------------------------------------------------------------------


def test_search_r1_reward_exact_match_with_format_credit():
    rm = _load(os.path.join(SEARCH_R1, "reward.py"), "search_r1_reward")
    assert rm.score("<think>x</think><search>capital</search>\n\n<information>Doc 1 <answer>Zed</answer>"
                    "</information>\n\n<answer> The Staeltris. </answer>", "Staeltris") == 1.0
    assert rm.score("<answer>Keltan</answer>", "Staeltris") == rm.FORMAT_SCORE
    assert rm.score("< answer > staeltris < / answer >", ["Keltan", "Staeltris"]) == 1.0
    assert rm.score("Staeltris", "Staeltris") == 0.0  # no answer tag
    assert rm.score("<search>q<answer>Staeltris</answer>", "Staeltris") == 0.0  # unclosed search
    # the answer inside an information block is environment text, not the model's answer
    assert rm.score("<information><answer>Staeltris</answer></information>", "Staeltris") == 0.0


def test_search_r1_bm25_ranks_the_passage_that_answers_first(tmp_path):
    data = _load(os.path.join(SEARCH_R1, "make_data.py"), "search_r1_data")
    server = _load(os.path.join(SEARCH_R1, "retrieval_server.py"), "search_r1_server")
    corpus, qa = data.make_data(num_countries=40, seed=0)
    assert (corpus, qa) == data.make_data(num_countries=40, seed=0)  # deterministic
    retriever = server.Retriever(corpus)
    capital_qs = [q for q in qa if q["question"].startswith("What is the capital of")]
    hits = sum(q["answer"] in retriever.search(q["question"], 1)[0]["text"] for q in capital_qs)
    assert hits == len(capital_qs)
    assert retriever.search("???", 3) == []


def test_calculator_tool_and_reward():
    gen = _load(os.path.join(CALCULATOR, "generate.py"), "calc_generate")
    rm = _load(os.path.join(CALCULATOR, "reward.py"), "calc_reward")
    assert gen.calculate(" 2 + 5", [3, 4]) == "7"  # the expression written in the call
    assert gen.calculate(" now", [3, 4]) == "7"  # a bare call: the task's secret numbers
    assert gen.calculate("", None) == "error"
    assert rm.score("7 call", "7", tool_calls=1) == 1.0
    assert rm.score("answer 7", "7", tool_calls=0) == 1.0
    assert rm.score("6", "7", tool_calls=1) == rm.FORMAT_SCORE
    assert rm.score("dog", "7", tool_calls=1) == rm.FORMAT_SCORE  # the credit is for calling, then answering
    assert rm.score("call call", "7", tool_calls=1) == 0.0
    assert rm.score("", "7", tool_calls=1) == 0.0
    assert rm.score("6", "7", tool_calls=0) == 0.0
    rows = _load(os.path.join(CALCULATOR, "make_data.py"), "calc_data").make_rows(200, seed=0)
    for row in rows:  # the numbers are the environment's, not the prompt's
        assert sum(row["metadata"]["numbers"]) == int(row["label"]) and not any(c.isdigit() for c in row["prompt"])
    assert len({row["label"] for row in rows}) == 10


# --- end to end ------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_search_r1_run_cpu_one_rollout_starts_and_stops_the_server(tiny_model_dir, tmp_path):
    port = free_port("127.0.0.1")
    pidfile = tmp_path / "server.pid"
    before = run_processes()
    out = subprocess.run(
        ["bash", os.path.join(SEARCH_R1, "run-cpu.sh"), "--num-rollout", "1", *SMALL,
         "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")],
        check=False, capture_output=True, text=True, timeout=220, cwd=str(tmp_path),
        env=_env(MODEL_DIR=tiny_model_dir, SEARCH_R1_PORT=str(port), SEARCH_R1_PIDFILE=str(pidfile),
                 SEARCH_R1_RETRIEVE_FIRST="1"),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"answers on http://127.0.0.1:{port}/retrieve" in out.stdout
    server_pid = int(pidfile.read_text())
    assert _gone(server_pid), f"retrieval server {server_pid} still running"
    assert not _listening(port)
    assert wait_for_no_new_processes(before) == {}

    samples = _samples(tmp_path / "rollout_0.pt")
    assert len(samples) == 4
    for s in samples:
        meta = s["metadata"]
        assert meta["turns"] >= 1 and meta["search_calls"] >= 1, meta
        assert meta["retrieved_passages"] >= 1, meta  # the server answered with passages
        mask = s["loss_mask"]
        assert len(mask) == len(s["rollout_log_probs"]) == s["response_length"]
        assert 0 in mask and 1 in mask, mask  # environment tokens (information) and model tokens
        assert all(lp == 0.0 for lp, m in zip(s["rollout_log_probs"], mask) if m == 0)
        assert "information" in s["response"]
        assert s["reward"] in (0.0, 0.1, 1.0)


@pytest.mark.timeout(200)  # ~10-20 s alone; bash builds data, starts and polls the server, imports train.py
def test_search_r1_run_cpu_stops_the_server_when_training_fails(tiny_model_dir, tmp_path):
    port = free_port("127.0.0.1")
    pidfile = tmp_path / "server.pid"
    out = subprocess.run(
        ["bash", os.path.join(SEARCH_R1, "run-cpu.sh"), "--num-rollout", "1", *SMALL, "--global-batch-size", "5"],
        check=False, capture_output=True, text=True, timeout=180, cwd=str(tmp_path),
        env=_env(MODEL_DIR=tiny_model_dir, SEARCH_R1_PORT=str(port), SEARCH_R1_PIDFILE=str(pidfile)),
    )
    assert out.returncode != 0
    assert "--global-batch-size 5" in out.stderr, out.stderr[-2000:]
    assert _gone(int(pidfile.read_text()))
    assert not _listening(port)


@pytest.mark.timeout(180)
def test_tool_calculator_run_cpu_one_rollout(tiny_model_dir, tmp_path):
    before = run_processes()
    out = subprocess.run(
        ["bash", os.path.join(CALCULATOR, "run-cpu.sh"), "--num-rollout", "1", "--rollout-batch-size", "4",
         "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--micro-batch-size", "16",
         "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")],
        check=False, capture_output=True, text=True, timeout=170, cwd=str(tmp_path),
        env=_env(MODEL_DIR=tiny_model_dir, DATA=str(tmp_path / "calc.jsonl")),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert wait_for_no_new_processes(before) == {}
    samples = _samples(tmp_path / "rollout_0.pt")
    assert len(samples) == 16
    gen = _load(os.path.join(CALCULATOR, "generate.py"), "calc_generate")
    for s in samples:
        meta = s["metadata"]
        assert 1 <= meta["turns"] <= 2 and meta["tool_calls"] <= 1, meta
        assert len(s["loss_mask"]) == s["response_length"] <= 64
        assert (0 in s["loss_mask"]) == (meta["tool_calls"] == 1)  # the tool result is masked out
        assert s["reward"] in (0.0, 0.1, 1.0)
        if meta["tool_calls"]:  # the calculator's result: the call's expression, else the row's secret sum
            call = gen.CALL.search(s["response"].split("<|im_end|>")[0])
            expected = gen.calculate(call.group(1), meta["numbers"])
            assert f"tool {expected} " in s["response"].replace("<|im_end|>", " ").replace("\n", " "), s["response"]
