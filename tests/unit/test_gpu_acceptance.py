"""tools/gpu_acceptance.py on CPU: its runner with real subprocesses, its outputs, and its registry against the doc.

The runner runs as users run it (`python tools/gpu_acceptance.py ...`, a subprocess) over a small registry of rows
written here: one that passes with a figure, one that exits 1, one whose output fails its check, one that runs past
its timeout leaving children behind (one in a session of its own), one needing two GPUs, one needing a card of
100 GB, and pytest rows whose
test skips / passes beside a skip. The real registry (tools/gpu_acceptance_rows.py) must be what
docs/gpu_acceptance.md lists, fit its parts, name files and benchmark options that exist, and its new GPU tests'
command lines must pass the real argument validation (flags that combine), checked here without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO_ROOT
from tools import gpu_acceptance as tool
from tools import gpu_acceptance_rows as registry

TOOL = os.path.join(REPO_ROOT, "tools", "gpu_acceptance.py")

ROWS_MODULE = '''
from tools.gpu_acceptance_rows import Row, grab

def must_be_calm(out):
    return [] if "calm" in out else ["the output is not calm"]

PYTEST = "python -m pytest -s -rs -p no:cacheprovider {tests}"
ROWS = (
    Row(1, "passes", "demo", "echo 'loss: 0.25'; echo \\"$ROW_OUT\\" > \\"$ROW_OUT/where\\"", timeout_s=30,
        estimate_s=1, part="a", must_show="a figure", kind="command", figures=grab(loss=r"loss: (\\S+)")),
    Row(2, "exits 1", "demo", "echo boom; exit 1", timeout_s=30, estimate_s=1, part="a", must_show="-",
        kind="command"),
    Row(3, "fails its check", "demo", "echo stormy", timeout_s=30, estimate_s=1, part="a", must_show="calm",
        kind="command", check=must_be_calm),
    Row(4, "runs past its timeout", "demo",
        "sleep 300 & echo $! >> {pids}; setsid sleep 300 & echo $! >> {pids}; echo started; wait",
        timeout_s=2, estimate_s=1, part="b", must_show="-", kind="command"),
    Row(5, "needs two GPUs", "demo", "echo never", timeout_s=30, estimate_s=1, part="b", must_show="-",
        kind="command", gpus=2),
    Row(6, "every test skips", "demo", PYTEST, timeout_s=60, estimate_s=2, part="b", must_show="-"),
    Row(7, "needs a big card", "demo", "echo big", timeout_s=30, estimate_s=1, part="b", must_show="-",
        kind="command", gpu_gb=100),
)
'''
TESTS_FILE = '''
import pytest

def test_skipped():
    print("[demo] value 7")
    pytest.skip("no device here")
'''


def run_tool(tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_ROOT]))
    return subprocess.run([sys.executable, TOOL, "--registry", "demo_rows:ROWS", *args], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=timeout)


@pytest.fixture
def demo(tmp_path):
    pids = tmp_path / "pids"
    tests = tmp_path / "demo_cases.py"
    tests.write_text(TESTS_FILE)
    (tmp_path / "demo_rows.py").write_text(ROWS_MODULE.replace("{pids}", shlex.quote(str(pids)))
                                           .replace("{tests}", shlex.quote(str(tests))))
    return tmp_path


def test_runner_statuses_figures_reports_and_no_process_left(demo):
    out = demo / "out"
    start = time.monotonic()
    done = run_tool(demo, "--out", str(out), "--gpus", "1", "--gpu-gb", "79.2", "--kill-grace", "1")
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr  # rows failed

    report = json.loads((out / "acceptance.json").read_text())
    rows = {r["id"]: r for r in report["rows"]}
    assert {i: rows[i]["status"] for i in rows} == {1: "pass", 2: "fail", 3: "fail", 4: "timeout", 5: "skip",
                                                    6: "skip", 7: "skip"}
    assert rows[1]["figures"] == {"loss": "0.25"}
    assert (out / "row01" / "where").read_text().strip() == str(out / "row01")  # $ROW_OUT is the row's folder
    assert rows[2]["reason"] == "exited 1"
    assert rows[3]["reason"] == "the output is not calm"
    assert rows[4]["reason"] == "killed after 2 s" and rows[4]["seconds"] < 20, rows[4]
    assert rows[5]["reason"] == "needs 2 GPUs, 1 visible" and rows[5]["seconds"] == 0
    assert rows[6]["reason"] == "no device here"  # pytest's skip reason
    assert rows[7]["reason"] == "needs cards of ≥ 100 GB, these have 79 GB (--gpu-gb to assume otherwise)"
    for i in (1, 2, 3, 4, 6):
        assert (out / rows[i]["log"]).is_file()
    assert "boom" in (out / rows[2]["log"]).read_text()
    assert "[demo] value 7" in (out / rows[6]["log"]).read_text()  # pytest ran with -s

    pids = [int(p) for p in (demo / "pids").read_text().split()]
    assert len(pids) == 2 and not any(tool.alive(p) for p in pids), pids  # the setsid child too
    assert took < 60

    md = (out / "acceptance.md").read_text()
    assert report["commit"] and report["versions"]["torch"] and report["gpu"]
    assert f"commit `{report['commit']}`" in md
    assert re.search(r"^\| 1 \| passes \| pass \| \d+ \| loss: 0\.25 \|$", md, re.M), md
    assert re.search(r"^\| 4 \| runs past its timeout \| timeout \(killed after 2 s\) \|", md, re.M), md
    table = done.stdout[done.stdout.index("  #  name"):]  # the console table comes last
    assert all(f"  {i}  " in table for i in rows)


def test_part_selection_rows_order_and_list(demo):
    out = demo / "out"
    done = run_tool(demo, "--out", str(out), "--gpus", "1", "--rows", "3,1")
    assert done.returncode == 1
    assert [r["id"] for r in json.loads((out / "acceptance.json").read_text())["rows"]] == [3, 1]

    done = run_tool(demo, "--out", str(out), "--gpus", "1", "--part", "a")
    assert [r["id"] for r in json.loads((out / "acceptance.json").read_text())["rows"]] == [1, 2, 3]

    listed = run_tool(demo, "--list")
    assert listed.returncode == 0 and "part a: 3 s estimated" in listed.stdout
    assert "part b: 5 s estimated (needs 2 GPUs) (cards of ≥ 100 GB)" in listed.stdout
    done = run_tool(demo, "--out", str(out), "--gpus", "1", "--gpu-gb", "139.8", "--rows", "7")
    assert done.returncode == 0 and json.loads((out / "acceptance.json").read_text())["rows"][0]["status"] == "pass"
    assert re.search(r"^\s+4\s+runs past its timeout\s+~\s+1 s", listed.stdout, re.M), listed.stdout
    assert not (demo / "gpu_acceptance_out").exists()  # --list runs nothing
    bad = run_tool(demo, "--part", "z")
    assert bad.returncode != 0 and "parts are a, b" in bad.stderr


def test_budget_skips_what_does_not_fit(demo):
    out = demo / "out"
    done = run_tool(demo, "--out", str(out), "--gpus", "1", "--rows", "1,6", "--budget", "0.9")
    rows = {r["id"]: r for r in json.loads((out / "acceptance.json").read_text())["rows"]}
    assert rows[1]["status"] == "pass"  # estimate 1 s: more than half of it is left
    assert rows[6]["status"] == "skip" and rows[6]["reason"].startswith("--budget"), rows[6]
    assert done.returncode == 0


PYTEST_END = "=========== {} in 3.21s ===========\n"


@pytest.mark.parametrize(("rc", "said", "status", "reason"), [
    (0, PYTEST_END.format("2 passed, 1 deselected"), "pass", ""),
    (0, "SKIPPED [1] t.py:8: no device\n" + PYTEST_END.format("1 passed, 1 skipped"), "fail",
     "1 of 2 skipped: no device"),
    (1, PYTEST_END.format("1 failed, 1 passed"), "fail", "pytest exited 1: 1 failed, 1 passed"),
    (5, PYTEST_END.format("no tests ran"), "fail", "pytest exited 5: no summary"),
    (0, PYTEST_END.format("1 passed, 1 xfailed"), "pass", ""),
    (0, "SKIPPED [2] t.py:3: needs CUDA\n" + PYTEST_END.format("2 skipped"), "skip", "needs CUDA"),
])
def test_pytest_outcome_rules(rc, said, status, reason):
    row = registry.Row(1, "r", "a", "true", timeout_s=1, estimate_s=1, part="p", must_show="-")
    assert tool.judge(row, rc, said) == (status, reason)


def test_commit_without_git_comes_from_the_env_or_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "ROOT", str(tmp_path))  # no .git there
    monkeypatch.delenv(tool.COMMIT_ENV, raising=False)
    assert tool.commit() == "unknown"
    (tmp_path / tool.COMMIT_FILE).write_text("abc123\n")
    assert tool.commit() == "abc123"
    monkeypatch.setenv(tool.COMMIT_ENV, "def456")
    assert tool.commit() == "def456"


def test_commit_file_wins_over_a_git_checkout(tmp_path, monkeypatch):
    """The device's copy can carry a stale .git: the `.commit` written for the copy names what runs."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("a")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(tool, "ROOT", str(tmp_path))
    monkeypatch.delenv(tool.COMMIT_ENV, raising=False)
    assert tool.commit() == head
    (tmp_path / "a.txt").write_text("b")
    assert tool.commit() == head + "+dirty"
    (tmp_path / tool.COMMIT_FILE).write_text("abc123\n")
    assert tool.commit() == "abc123"


# ---- the real registry ----------------------------------------------------------------------------------------


def test_doc_lists_exactly_the_registry():
    assert tool.doc_rows() == tool.markdown_rows(), (
        "docs/gpu_acceptance.md's rows differ from tools/gpu_acceptance_rows.py: paste the output of "
        "`python tools/gpu_acceptance.py --markdown-rows` between its markers")


def test_parts_fit_a_device_call_and_perf_is_apart():
    ids = [r.id for r in registry.ROWS]
    assert ids == list(range(1, len(ids) + 1))
    for part in registry.PARTS:
        rows = [r for r in registry.ROWS if r.part == part]
        assert sum(r.estimate_s for r in rows) <= registry.PART_LIMIT_S, (part, [r.id for r in rows])
        assert all(r.timeout_s <= 600 for r in rows)
    for r in registry.ROWS:
        assert (r.area == "performance") == r.part.startswith("perf"), r
        assert (r.gpus > 1) == (r.part == "x2"), r


def test_commands_name_files_and_benchmark_options_that_exist():
    for r in registry.ROWS:
        for path in re.findall(r"(?:tests|benchmarks)/[\w/]+\.py", r.command):
            assert os.path.isfile(os.path.join(REPO_ROOT, path)), (r.id, path)
        for script, flags in re.findall(r"python (benchmarks/\w+\.py)([^&]*)", r.command):
            with open(os.path.join(REPO_ROOT, script)) as f:
                source = f.read()
            for flag in re.findall(r"(--[\w-]+)", flags):  # each an option the benchmark's parser adds
                assert re.search(rf"add_argument\(\s*\"{flag}\"", source), f"row {r.id}: {script} has no {flag}"


REPORT = textwrap.dedent("""\
    qwen3-4b, megatron + sglang colocated on H200, 32 prompts x 8 samples x 1024 tokens
    ## sglang, handoff: exit 0, device peak 95.0 GB
    | step | step s | handoff s | handoff / step | engine release s | engine resume s | offload s | onload s | actor GB after offload | rollout s | train s | push s | trainer allocator peak GiB |
    | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | 0 | 90.00 | 40.00 | 44.4% | 1.00 | 2.00 | 13.50 | 3.00 | 1.20 | 15.00 | 27.00 | 2.00 | 80.0 |
    | 1 | 34.00 | 2.72 | 8.0% | 0.50 | 0.60 | 2.00 | 2.00 | 1.20 | 14.50 | 17.50 | 0.20 | 79.1 |
    | 2 | 36.00 | 3.24 | 9.0% | 0.50 | 0.60 | 2.00 | 2.50 | 1.21 | 14.70 | 17.10 | 0.30 | 79.4 |

    | step | after onload: alloc / reserved / process / device GB | after offload all but weights: alloc / reserved / process / device GB | after offload: alloc / reserved / process / device GB |
    | ---: | ---: | ---: | ---: |
    | 0 | 60.00 / 62.00 / 63.00 / 70.00 | 9.00 / 9.50 / 10.10 / 20.20 | 0.10 / 0.20 / 1.20 / 93.00 |

    | phase | device GB after | trainer GB after | engine GB after | trainer peak GB in phase | engine peak GB in phase | device peak GB in phase |
    | --- | ---: | ---: | ---: | ---: | ---: | ---: |
    | engines release weights, kv_cache, cuda_graph | 27.4 | 25.4 | 2.0 | 25.4 | 2.0 | 28.0 |
    | engines resume kv_cache, cuda_graph (then generate) | 93.4 | 1.2 | 92.1 | 1.2 | 92.1 | 94.0 |
    | engines release weights, kv_cache, cuda_graph | 3.0 | 1.2 | 1.8 | 1.2 | 92.0 | 93.0 |
    | trainers onload (then train, save) | 80.0 | 78.0 | 1.8 | 78.0 | 1.8 | 120.0 |
    PASS: trainer memory after onload (process_gb) 63.00 GB at rollout 1 -> 63.10 GB at rollout 2: +0.10 GB (tolerance 1.0 GB)
    FAIL: trainer memory after offload (process_gb) 1.20 GB at rollout 1 -> 3.20 GB at rollout 2: +2.00 GB (tolerance 1.0 GB)
    """)


def test_figures_and_checks_read_colocate_memory_reports():
    row = next(r for r in registry.ROWS if r.id == 1)
    assert row.check(REPORT) == []
    figures = row.figures(REPORT)
    assert figures["steps"] == "3" and figures["handoff/step"] == "8.5%" and figures["engine freed"] == "98%"
    assert figures["trainer freed"] == "98%"
    assert (figures["rollout s"], figures["train s"], figures["push s"]) == ("14.60", "17.30", "0.25")
    assert figures["trainer allocator peak GiB"] == "79.4"
    slow = REPORT.replace("| 2 | 36.00 | 3.24 | 9.0% |", "| 2 | 36.00 | 10.08 | 28.0% |")
    assert row.check(slow) == ["the handoff took 18.0% of the step (> 10%)"]
    failed = REPORT.replace("exit 0, device peak 95.0 GB", "exit 1, device peak 144.2 GB; torch.OutOfMemoryError")
    assert row.check(failed)[0].startswith("train.py exited 1: torch.OutOfMemoryError")
    kept = REPORT.replace("| trainers onload (then train, save) | 80.0 | 78.0 | 1.8 | 78.0 | 1.8 |",
                          "| trainers onload (then train, save) | 80.0 | 78.0 | 30.0 | 78.0 | 30.0 |")
    assert row.check(kept) == ["the engine freed 67% of its GB (< 90%)"]  # the engine held 30 of 92 GB in training
    # The hf engine releases in ~0.1 s: the sample after its generate phase is read once it has released and the
    # trainer is onloading. The peaks in the phases are what each side held while the other one worked.
    fast = REPORT.replace("| engines resume kv_cache, cuda_graph (then generate) | 93.4 | 1.2 | 92.1 | 1.2 |",
                          "| engines resume kv_cache, cuda_graph (then generate) | 69.9 | 67.2 | 2.5 | 1.2 |")
    assert row.check(fast) == [] and row.figures(fast)["engine freed"] == "98%"
    assert row.check("nothing") == ["no '## sglang, handoff' report in the output"]
    # What a bare CUDA process holds no release can give back: a side is judged on its GB above it. A small
    # engine (11 GB at its peak) that keeps 1.5 GB freed 86% of all it held but 95% of what it could free.
    small = REPORT.replace("| 93.4 | 1.2 | 92.1 | 1.2 | 92.1 | 94.0 |", "| 13.4 | 1.2 | 11.0 | 1.2 | 11.0 | 14.0 |")
    small = small.replace("| 80.0 | 78.0 | 1.8 | 78.0 | 1.8 | 120.0 |", "| 80.0 | 78.0 | 1.5 | 78.0 | 1.5 | 120.0 |")
    assert row.check(small) == ["the engine freed 86% of its GB (< 90%)"]
    floored = "bare CUDA process: 1.00 GB (nvidia-smi: ...)\n" + small
    assert row.check(floored) == [] and row.figures(floored)["engine freed above floor"] == "95%"
    assert row.figures(floored)["engine freed"] == "86%" and row.figures(floored)["bare CUDA process GB"] == "1.00"
    assert row.check(floored.replace("| 78.0 | 1.5 | 78.0 | 1.5 |", "| 78.0 | 2.5 | 78.0 | 2.5 |")) == [
        "the engine freed 85% of its GB above the 1.00 GB of a bare CUDA process (< 90%)"]
    assert row.check("bare CUDA process: nan GB (...)\n" + small) == ["the engine freed 86% of its GB (< 90%)"]

    flat = next(r for r in registry.ROWS if "--steps 10" in r.command)
    assert flat.figures(REPORT)["trainer after offload"] == "+2.00 GB (grew)"
    assert flat.check(REPORT) == ["3 step(s) logged, fewer than 10", "the trainer's memory after offload grew +2.00 GB"]


@pytest.fixture
def plan_inputs(tmp_path) -> tuple[str, str]:
    """The tiny Qwen3's config and tokenizer without its weights (all a plan reads), and a few toy prompts."""
    from tools.make_tiny_model import build_config, build_tokenizer
    from tools.make_toy_data import write_toy_data

    model = str(tmp_path / "tiny-qwen3")
    tokenizer = build_tokenizer(model)
    build_config("qwen3", "tiny", ((len(tokenizer) + 63) // 64) * 64, tokenizer).save_pretrained(model)
    return model, write_toy_data(str(tmp_path / "toy.jsonl"), num_samples=20, seed=0)


def test_vlm_row_figures_are_what_the_test_printed_not_its_failure_listing():
    """Row 23's figures come from the lines the test printed, not from pytest's listing of the test's source when it
    failed (the 2026-12-05 run showed `{push[-1] if push else 'not reached'}")` as the vision push)."""
    row = next(r for r in registry.ROWS if r.id == 23)
    out = textwrap.dedent("""\
        [image contract vs sglang] 1 failed, 4 passed in 16.05s; not passed: ['FAILED test_a']
        [image contract vs sglang] vision push: image prompt max |Δ log-prob| 0.370, text prompt 0.00e+00
        [vlm megatron + sglang] weight version per rollout [1.0, 2.0, 3.0]; engine/trainer |Δ log-prob| ['1.03e-03']; raw reward [0.0]; step s [15.09, 2.79, 2.7]
        >       print(f"[image contract vs sglang] vision push: {push[-1] if push else 'not reached'}")
        E       print(f"[image contract vs sglang] {said}; not passed: {x}")
        """)
    assert row.figures(out) == {"contract": "1 failed, 4 passed in 16.05s",
                                "vision push": "image prompt max |Δ log-prob| 0.370, text prompt 0.00e+00",
                                "logprob diff": "['1.03e-03']", "step s": "[15.09, 2.79, 2.7]"}


def test_new_gpu_tests_command_lines_pass_validation(plan_inputs, tmp_path, monkeypatch):
    """The flags each new GPU test adds combine (the real parser; `--dry-run-cuda` plans the GPU run here)."""
    tiny_model_dir, toy_data_path = plan_inputs
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    import train_async
    from slime.config.arguments import parse_args
    from tests.gpu import sglang_runs as runs
    from tests.gpu.test_megatron_optimizer_offload_gpu import FORMS, OFFLOAD
    from tests.gpu.test_sglang_train import train_cmd
    from tests.gpu.test_sglang_two_gpus import checksum_algorithm, disaggregated_cmd

    tb = str(tmp_path / "tb")
    delta = ["--update-weight-transport", "disk", "--update-weight-mode", "delta", "--update-weight-disk-dir",
             str(tmp_path / "push"), "--update-weight-local-checkpoint-dir", str(tmp_path / "local"),
             "--update-weight-delta-checksum", checksum_algorithm()]
    cases = {
        "weights checker, megatron": train_cmd("megatron", tiny_model_dir, toy_data_path, tb)
        + [*runs.NO_CUDA_GRAPH, "--check-weight-update-equal"],
        "weights checker, fsdp": train_cmd("fsdp", tiny_model_dir, toy_data_path, tb)
        + [*runs.NO_CUDA_GRAPH, "--check-weight-update-equal"],
        **{f"optimizer offload, {form}": train_cmd("megatron", tiny_model_dir, toy_data_path, tb)
           + [*runs.NO_CUDA_GRAPH, *OFFLOAD, *extra] for form, extra in FORMS.items()},
        "train_async": disaggregated_cmd("megatron", tiny_model_dir, toy_data_path, tb),
        "delta": disaggregated_cmd("megatron", tiny_model_dir, toy_data_path, tb) + delta,
    }
    for name, cmd in cases.items():
        args = parse_args([*cmd[2:], "--dry-run", "--dry-run-cuda"])
        if name == "train_async":
            train_async.check_async_args(args)
            assert not args.colocate and not args.offload_rollout
        if name.startswith("optimizer offload"):
            assert args.optimizer_cpu_offload and args.use_distributed_optimizer
            assert args.offload_train == (name.endswith("handoff")), name
        if name == "delta":
            assert args.update_weight_mode == "delta" and not args.colocate
        if name.startswith("weights checker"):
            assert args.check_weight_update_equal and args.colocate and args.offload_rollout


def test_vlm_gpu_test_command_line_passes_validation(tmp_path, monkeypatch):
    """Row 23's train.py command (tests/gpu/test_vlm_sglang_gpu.py) parses and plans for the GPU (`--dry-run-cuda`):
    images with Megatron + SGLang colocated, the vision tower's attention backend forwarded to SGLang."""
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    from slime.config.arguments import parse_args
    from tests.gpu.test_vlm_sglang_gpu import vlm_train_cmd
    from tools.make_tiny_model import build_config, build_processor, build_tokenizer
    from tools.make_toy_data import write_toy_data

    model = str(tmp_path / "tiny-vlm")  # config, tokenizer and processor without weights: all a plan reads
    tokenizer = build_tokenizer(model, chat_template="qwen2_5_vl")
    build_processor(model)
    build_config("qwen2_5_vl", "tiny", ((len(tokenizer) + 63) // 64) * 64, tokenizer).save_pretrained(model)
    data = write_toy_data(str(tmp_path / "colour.jsonl"), num_samples=8, seed=0, task="colour")
    args = parse_args([*vlm_train_cmd(model, data, str(tmp_path))[2:], "--dry-run", "--dry-run-cuda"])
    assert args.multimodal_keys == {"image": "images"} and args.rollout_backend == "sglang" and args.colocate
    assert args.sglang_args["mm_attention_backend"] == "sdpa"


GRPO_REPORT = textwrap.dedent("""\
    | system | step s | rollout s | rollout tok/s | train s | train tok/s | weight sync s | handoff s | peak GB |
    | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | slime-sglang | 3.38 | 1.69 | 38,687.51 | 1.13 | 72,657.49 | 0.04 | 0.49 | 58.58 |
    | trl | 9.81 | 7.62 | 8,602.03 | 2.19 | 37,453.80 | - | - | 83.94 |
    | TRL / slime-sglang (time), slime-sglang / TRL (tok/s, GB) | 2.90x | 4.50x | 4.50x | 1.94x | 1.94x | - | - | 0.70x |
    """)

DECODE_REPORT = textwrap.dedent("""\
    | kv cache | norms | rotary | projections | overlap | batch | wall s | prefill s | decode steps | ms / decode step | bound ms / step | efficiency | decode tok/s |
    | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | slots | fused | fused | op | off | 64 | 1.33 | 0.03 | 255 | 5.08 | 0.60 | 11.9% | 12,603.93 |
    | slots | fused | fused | op | on | 64 | 1.24 | 0.03 | 256 | 6.71 | 0.60 | 12.7% | 13,432.55 |
    | slots | fused | fused | fused | on | 64 | 1.07 | 0.02 | 256 | 4.09 | 0.87 | 21.2% | 15,654.53 |
    | slots | fused | fused | fused | on | 256 | 2.06 | 0.06 | 256 | 6.84 | 2.28 | 29.0% | 32,658.05 |
    | sglang triton | sglang | sglang | sglang | sglang | 64 | 0.83 | 0.08 | 255 | 2.92 | 0.60 | 20.7% | 21,885.18 |
    """)

KERNEL_STEP_REPORT = textwrap.dedent("""\
    | layout | tokens | forward s | forward tok/s | forward MFU | train s | train tok/s | train MFU | peak GB |
    | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | thd:torch+torchrope | 81920 | 0.60 | 136,805 | 21.3% | 1.59 | 51,581 | 24.1% | 55.8 |

    | layout | tokens | forward s | forward tok/s | forward MFU | train s | train tok/s | train MFU | peak GB |
    | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | thd:triton+torchrope | 81920 | 0.41 | 200,317 | 31.2% | 1.09 | 75,395 | 35.2% | 54.5 |
    | thd:torch+torchrope | 81920 | 0.60 | 136,805 | 21.3% | 1.59 | 51,581 | 24.1% | 55.8 |
    """)


def test_speed_rows_fail_on_a_regression():
    """The perf rows and the 4B handoff rows carry speed ceilings: the last measured figures hold, a slower run
    fails naming the figure."""
    rows = {r.id: r for r in registry.ROWS}
    assert rows[15].check(GRPO_REPORT) == []
    slower = GRPO_REPORT.replace("| slime-sglang | 3.38 |", "| slime-sglang | 4.02 |").replace("| 2.90x |", "| 2.44x |")
    assert rows[15].check(slower) == ["slime-sglang step 4.02 s (> 3.7 s: a speed regression)",
                                      "TRL / slime-sglang step 2.44x (< 2.8x)"]
    assert rows[15].check("no table") == ["no slime-sglang row or TRL ratio in grpo_step.py's table"]
    megatron = GRPO_REPORT.replace("slime-sglang", "slime-megatron")
    assert rows[16].check(megatron) == []
    assert rows[16].check(megatron.replace("| 2.90x |", "| 0.83x |")) == ["TRL / slime-megatron step 0.83x (< 1.0x)"]
    assert rows[17].check(DECODE_REPORT) == ["hf engine decode 4.09 ms/step at batch 64 (> 3.9 ms: a speed regression)"]
    today = DECODE_REPORT.replace("| 1.07 | 0.02 | 256 | 4.09 |", "| 0.89 | 0.03 | 256 | 3.38 |")
    assert rows[17].check(today) == []
    slow_256 = today.replace("| 256 | 2.06 | 0.06 | 256 | 6.84 |", "| 256 | 2.06 | 0.06 | 256 | 9.20 |")
    assert rows[17].check(slow_256) == ["hf engine decode 9.20 ms/step at batch 256 (> 7.3 ms: a speed regression)"]
    assert rows[17].check(DECODE_REPORT.replace("| slots | fused | fused | fused | on | 64 |", "| paged | fused | fused | fused | on | 64 |")) == [
        "no slots row at batch 64 in decode_speed.py's table"]  # the op and plain rows (6.71, 5.08 ms) are not checked
    assert rows[17].figures(DECODE_REPORT)["slots (norms fused, rotary fused, projections op, overlap on) batch 64 ms/step"] == "6.71"
    assert rows[17].figures(DECODE_REPORT)["sglang triton (norms sglang, rotary sglang, projections sglang, overlap sglang) batch 64 ms/step"] == "2.92"
    assert rows[27].check(KERNEL_STEP_REPORT) == []
    assert rows[27].check(KERNEL_STEP_REPORT.replace("| 1.09 | 75,395 |", "| 1.31 | 62,534 |")) == [
        "train step 1.31 s with the Triton kernels against 1.59 s with the torch form: less than 1.3x (a speed "
        "regression)"]
    assert rows[27].check(KERNEL_STEP_REPORT.split("\n\n")[0]) == [
        "megatron_train.py printed no train step for ['thd:triton+torchrope']"]  # the torch layout's table alone
    rope = KERNEL_STEP_REPORT.replace("| thd:torch+torchrope | 81920 | 0.60", "| thd:triton+rope | 81920 | 0.39").replace(
        "| 1.59 | 51,581 |", "| 1.02 | 80,300 |")
    assert rows[30].check(rope) == []
    assert rows[30].check(rope.replace("| 1.02 | 80,300 |", "| 1.15 | 71,200 |")) == [
        "train step 1.15 s with the Triton rotary embedding against 1.09 s with megatron-core's: less than 1.0x (a "
        "speed regression)"]
    assert rows[30].check(KERNEL_STEP_REPORT) == ["megatron_train.py printed no train step for ['thd:triton+rope']"]
    triton_jobs = ("[weights checker, megatron, triton] weight version per rollout [1.0, 2.0, 3.0]; engine/trainer "
                   "|Δ log-prob| ['1.1e-03', '9.0e-04', '8.0e-04']; raw reward [0.1]; step s [5.0]\n" + GRPO_REPORT)
    assert rows[28].check(triton_jobs) == []
    assert rows[28].figures(triton_jobs) == {
        "megatron logprob diff": "['1.1e-03', '9.0e-04', '8.0e-04']", "slime-sglang step s": "3.38",
        "slime-sglang train s": "1.13", "trl step s": "9.81", "TRL / slime step": "2.90x"}
    assert rows[28].check(triton_jobs.replace("| 2.90x |", "| 2.17x |")) == ["TRL / slime-sglang step 2.17x (< 2.5x)"]
    attention = DECODE_REPORT.replace("| slots | fused | fused | fused | on | 64 | 1.07 | 0.02 | 256 | 4.09 |",
                                      "| slots:sdpa | fused | fused | fused | on | 64 | 1.07 | 0.02 | 256 | 4.09 |\n"
                                      "    | slots:triton-kv | fused | fused | fused | on | 64 | 0.90 | 0.02 | 256 | 3.60 |"
                                      ).replace("| slots | fused | fused | fused | on | 256 |",
                                                "| slots:sdpa | fused | fused | fused | on | 256 |")
    no_256 = ["batch 256: no slots:triton-kv row", "batch 256: no slots:triton row"]
    assert rows[29].check(attention) == ["batch 64: no slots:triton row", *no_256]
    kernel_64 = "slots:triton-kv (norms fused, rotary fused, projections fused, overlap on) batch 64 ms/step"
    assert rows[29].figures(attention)[kernel_64] == "3.60"
    assert rows[29].check("no table") == ["no slots rows in decode_speed.py's table"]
    fused = attention.replace("| 256 | 3.60 |", "| 256 | 3.60 |\n"
                              "    | slots:triton | fused | fused | fused | on | 64 | 0.90 | 0.02 | 256 | 3.40 |")
    assert rows[29].check(fused) == no_256
    assert rows[29].check(fused.replace("| 3.60 |", "| 4.20 |")) == [
        "batch 64: the Triton decode attention 4.20 ms/step, slower than SDPA's 4.09", *no_256]
    assert rows[29].check(fused.replace("| 3.40 |", "| 3.70 |")) == [
        "batch 64: the KV writes fused into the Triton decode attention 3.70 ms/step, slower than apart 3.60", *no_256]
    slow_step = REPORT.replace("| 1 | 34.00 | 2.72 | 8.0% |", "| 1 | 42.00 | 3.36 | 8.0% |")
    assert rows[1].check(slow_step) == ["the step took 39.00 s (> 38.0 s: a speed regression)"]
    assert rows[1].check(REPORT) == []


def test_vlm_3b_gpu_test_command_line_plans_for_the_gpu(tmp_path, monkeypatch, capsys):
    """Row 25's train.py command (tests/gpu/test_vlm_3b_sglang_gpu.py: row 23's at the Qwen2.5-VL-3B shape, a
    smaller batch) parses and plans for the GPU with the 3B config, and its figures read from its test's lines."""
    monkeypatch.setenv("SLIME_SGLANG_LAUNCHER", "sglang serve")
    from slime.config.arguments import parse_args
    from tests.gpu.sglang_runs import flag_value
    from tests.gpu.test_vlm_3b_sglang_gpu import BATCH
    from tests.gpu.test_vlm_sglang_gpu import vlm_train_cmd
    from tools.make_tiny_model import write_config
    from tools.make_toy_data import write_toy_data

    model = str(tmp_path / "qwen2.5-vl-3b")  # config, tokenizer and processor without weights: all a plan reads
    write_config(model, arch="qwen2_5_vl", size="qwen2.5-vl-3b")
    data = write_toy_data(str(tmp_path / "colour.jsonl"), num_samples=8, seed=0, task="colour")
    cmd = vlm_train_cmd(model, data, str(tmp_path), script="qwen2.5-vl-3b")
    for flag, value in BATCH.items():
        cmd = flag_value(cmd, flag, value)
    args = parse_args([*cmd[2:], "--dry-run", "--dry-run-cuda"])
    assert (args.num_layers, args.hidden_size, args.vocab_size) == (36, 2048, 151936)
    assert not args.untie_embeddings_and_output_weights and args.colocate and args.multimodal_keys
    assert (args.rollout_batch_size * args.n_samples_per_prompt, args.global_batch_size) == (16, 16)

    row = {r.id: r for r in registry.ROWS}[25]
    said = ("[vlm 3b] model written in 41.2 s (7.51 GB)\n[vlm 3b] train.py took 250.3 s (start-up included)\n"
            "[vlm 3b megatron + sglang] weight version per rollout [1.0, 2.0, 3.0]; engine/trainer |Δ log-prob| "
            "['1.10e-02', '1.20e-02', '1.30e-02']; raw reward [0.0, 0.0, 0.0]; step s [20.1, 12.3, 12.2]\n")
    assert row.figures(said) == {"model written": "41.2 s (7.51 GB)", "train py s": "250.3",
                                 "logprob diff": "['1.10e-02', '1.20e-02', '1.30e-02']",
                                 "step s": "[20.1, 12.3, 12.2]"}


def test_contract_run_keeps_its_log_under_row_out(tmp_path, monkeypatch):
    """A GPU row's contract run writes its output to `$ROW_OUT/<tag>.log` as it runs (row 23 was stopped with the
    output only in memory, and nothing came back), and returns what the file holds."""
    from tests.gpu.sglang_runs import kept_log
    from tests.gpu.test_contract_sglang_gpu import run_contract

    row_out = tmp_path / "row23"
    monkeypatch.setenv("ROW_OUT", str(row_out))
    assert kept_log(tmp_path / "t", "sglang.log") == str(row_out / "sglang.log")
    rc, said, summary, outcomes = run_contract("http://127.0.0.1:9", tmp_path, "image contract vs sglang",
                                               "tests/contract/test_image_api.py", "-k", "no_test_has_this_name")
    kept = (row_out / "image-contract-vs-sglang.log").read_text()
    assert rc == 5 and outcomes == [] and "deselected" in summary, said  # pytest's "no tests ran"
    assert kept == said
    monkeypatch.delenv("ROW_OUT")
    assert kept_log(tmp_path / "t", "sglang.log") == str(tmp_path / "t" / "sglang.log")


def test_dump_stacks_writes_every_threads_stack_of_a_stalled_server_to_its_log(tmp_path):
    """tests/gpu/sglang_runs.py `dump_stacks`: SIGABRT to the server's process group, whose processes run with
    PYTHONFAULTHANDLER=1 (as `sglang_server` starts them), puts each thread's Python stack in the log."""
    from tests.gpu.sglang_runs import SERVER_GROUPS, dump_stacks

    log = tmp_path / "server.log"
    stalled = "import threading, time\ndef stuck_in_vision_forward():\n    time.sleep(60)\n" \
              "threading.Thread(target=stuck_in_vision_forward).start()\nprint('up', flush=True)\ntime.sleep(60)\n"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", stalled], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"}, start_new_session=True)
    try:
        while "up" not in log.read_text():
            time.sleep(0.05)
        SERVER_GROUPS["http://stalled"] = proc.pid
        dump_stacks("http://stalled", wait_s=0.5)
        assert proc.wait(10) != 0
    finally:
        SERVER_GROUPS.pop("http://stalled", None)
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text and "stuck_in_vision_forward" in text
    dump_stacks("http://not-running")  # no such server: nothing to do
