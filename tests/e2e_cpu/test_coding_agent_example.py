"""slime's examples/coding_agent_rl (generate.py, swe.py), taken unchanged from the reference mirror at test time,
imports against our slime.agent; what needs no outside service runs (the task layer's git diff in a LocalSandbox,
the adapter service with a real tokenizer), and the E2B / agent-CLI paths are refused naming what is missing.
Skipped when the mirror of slime's repository is not on this machine."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import subprocess
import sys
import types

import pytest

from slime.agent.adapters import AnthropicAdapter
from slime.agent.harness import ClaudeCodeHarness
from slime.agent.sandbox import LocalSandbox, ServiceUnavailableError
from slime.utils.types import Sample

MIRROR = os.environ.get("SLIME_REFERENCE_MIRROR", "/work/.mirror/THUDM+slime/repo")
FILES = ("generate.py", "swe.py")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example's package `cagent_example` (generate, swe), imported with fast boot retries and no e2b env."""
    if not os.path.isdir(MIRROR):
        pytest.skip(f"slime's repository mirror {MIRROR} is absent (set SLIME_REFERENCE_MIRROR)")
    root = tmp_path_factory.mktemp("example")
    pkg = root / "cagent_example"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in FILES:
        src = subprocess.run(["git", "-C", MIRROR, "show", f"HEAD:examples/coding_agent_rl/{name}"],
                             capture_output=True, text=True, check=True).stdout
        (pkg / name).write_text(src)
    saved = {k: os.environ.get(k) for k in ("SWE_BOOT_RETRIES", "SWE_AGENT", "ADAPTER_PORT", "ADAPTER_BIND_HOST")}
    os.environ.update(SWE_BOOT_RETRIES="1", SWE_AGENT="claude_code", ADAPTER_PORT="0", ADAPTER_BIND_HOST="127.0.0.1")
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("cagent_example.generate"), importlib.import_module("cagent_example.swe")
    finally:
        sys.path.remove(str(root))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for name in [m for m in sys.modules if m.startswith("cagent_example")]:
            del sys.modules[name]


@pytest.fixture
def no_e2b(monkeypatch):
    for var in ("E2B_API_KEY", "SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY"):
        monkeypatch.delenv(var, raising=False)


def test_the_example_imports_and_picks_our_classes(example):
    generate, swe = example
    assert generate.HARNESS_CLS is ClaudeCodeHarness and generate.ADAPTER_CLS is AnthropicAdapter
    assert callable(generate.generate) and swe.PROTOCOL_SCALESWE == "scaleswe"


def test_the_task_layer_diffs_a_workspace_in_a_local_sandbox(example):
    _, swe = example

    async def main():
        async with LocalSandbox() as sb:
            await sb.exec("git init -q w && cd w && echo a > f.txt && git add f.txt && "
                          "git -c user.email=t@t -c user.name=t commit -qm base", check=True)
            await sb.write_file("w/f.txt", "b\n")
            await sb.write_file("w/new.py", "x = 1\n")
            await sb.write_file("w/PROBLEM_STATEMENT.md", "not part of the diff\n")
            return await swe.git_diff(sb, os.path.join(sb.root, "w"))

    diff = asyncio.run(main())
    assert "-a\n+b" in diff and "+x = 1" in diff and "PROBLEM_STATEMENT" not in diff


def test_grading_and_booting_are_refused_naming_what_e2b_needs(example, no_e2b):
    generate, swe = example
    md = {"protocol": swe.PROTOCOL_SCALESWE, "instance_id": "i1", "image": "img:1", "workdir": "/w",
          "grading": {"eval_cmd": "pytest"}}
    with pytest.raises(ServiceUnavailableError, match="E2B_API_KEY"):
        asyncio.run(swe.run_evaluation(md, diff_text="", timeout_sec=10))

    async def boot():
        async with generate.boot_agent_sandbox("img:1", "i1"):
            pass

    with pytest.raises(ServiceUnavailableError, match="SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY"):
        asyncio.run(boot())


@pytest.mark.timeout(120)
def test_generate_serves_the_adapter_and_aborts_the_sample_with_the_reason(example, no_e2b, tokenizer_dir,
                                                                            monkeypatch, caplog):
    generate, _ = example
    args = types.SimpleNamespace(hf_checkpoint=tokenizer_dir, rollout_max_context_len=0,
                                 sglang_tool_call_parser=None, sglang_reasoning_parser=None,
                                 sglang_router_ip="127.0.0.1", sglang_router_port=9)
    sample = Sample(index=0, group_index=0, prompt="fix it",
                    metadata={"instance_id": "i1", "image": "img:1", "workdir": "/w", "eval_cmd": "true"})
    # the adapter must be reachable from the sandbox: the example refuses without a public host
    with pytest.raises(RuntimeError, match="ADAPTER_PUBLIC_HOST is not set"):
        asyncio.run(generate.generate(args, sample, {"temperature": 1.0}))
    generate._AdapterService.clear_instances()
    monkeypatch.setattr(generate, "CONFIG", dataclasses.replace(generate.CONFIG, adapter_public_host="127.0.0.1"))
    try:
        with caplog.at_level(logging.WARNING):
            [out] = asyncio.run(generate.generate(args, sample, {"temperature": 1.0}))
        service = generate._AdapterService(args)
        assert service.app_handle.thread.is_alive() and service.adapter_url.startswith("http://127.0.0.1:")
        assert out.status == Sample.Status.ABORTED and out.remove_sample
        assert out.metadata["abort_reason"] == "exception:ServiceUnavailableError"
        assert "E2B_API_KEY" in caplog.text  # the log says what to set
        assert not service.adapter.store and not service.adapter.manager.has_session(out.session_id)
    finally:
        generate._AdapterService(args).app_handle.stop()
        generate._AdapterService.clear_instances()
