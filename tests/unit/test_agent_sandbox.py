"""slime.agent.sandbox and slime.agent.harness on this host: LocalSandbox runs and reaps real processes, E2B and
the agent CLIs are refused with a message naming what to install or set."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from slime.agent.harness import ClaudeCodeHarness, CodexHarness, HarnessContext
from slime.agent.sandbox import E2BSandbox, LocalSandbox, Sandbox, ServiceUnavailableError, exec_and_wait


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_local_sandbox_runs_commands_and_files_in_its_folder(tmp_path):
    async def main():
        async with LocalSandbox() as sb:
            assert isinstance(sb, Sandbox)
            rc, out, err = await sb.exec("pwd; echo $FOO; echo oops >&2; exit 3", env={"FOO": "bar"}, user="agent")
            assert (rc, out.split(), err) == (3, [sb.root, "bar"], "oops\n")
            with pytest.raises(RuntimeError, match="exited 3"):
                await sb.exec("exit 3", check=True)
            await sb.write_file("a/b.txt", "text")
            await sb.write_file(str(tmp_path / "abs.bin"), b"\x00\x01")
            (tmp_path / "src").write_text("from host")
            await sb.write_file("copy.txt", Path(tmp_path / "src"))
            assert await sb.read_file("a/b.txt") == "text" and await sb.read_file("copy.txt") == "from host"
            assert (tmp_path / "abs.bin").read_bytes() == b"\x00\x01" and await sb.read_file("missing") == ""
            code, out = await exec_and_wait(sb, cmd="echo working; (exit 4)", time_budget_sec=20, tag=sb.sandbox_id,
                                            poll_sec=0.2)
            assert code == 4 and "working" in out
            code, out = await exec_and_wait(sb, cmd="echo done", time_budget_sec=20, tag=sb.sandbox_id,
                                            poll_sec=0.2, want_output=True)
            assert (code, out) == (0, "done\n")
            code, _ = await exec_and_wait(sb, cmd="sleep 30", time_budget_sec=1, tag=sb.sandbox_id, poll_sec=0.2)
            assert code == -1  # past the budget
            return sb.root
    root = asyncio.run(main())
    assert not os.path.exists(root)


def test_a_timeout_kills_the_process_group_and_leaving_kills_detached_processes():
    async def main():
        async with LocalSandbox() as sb:
            with pytest.raises(TimeoutError, match="ran past its timeout of 1s"):
                await sb.exec("sleep 30 & echo $! > child.pid; sleep 30", timeout=1)
            child = int(await sb.read_file("child.pid"))
            await asyncio.sleep(0.2)
            assert not _alive(child)
            await sb.exec("setsid sleep 60 > /dev/null 2>&1 & echo $! > detached.pid")
            detached = int(await sb.read_file("detached.pid"))
            assert _alive(detached) and [p.pid for p in sb.processes()] == [detached]
        return detached
    detached = asyncio.run(main())
    assert not _alive(detached)


def test_e2b_is_refused_naming_the_package_the_key_and_the_image_key(monkeypatch):
    for var in ("E2B_API_KEY", "SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY"):
        monkeypatch.delenv(var, raising=False)

    async def main():
        async with E2BSandbox("python:3.11"):
            pass

    with pytest.raises(ServiceUnavailableError) as e:
        asyncio.run(main())
    message = str(e.value)
    assert "E2B_API_KEY" in message and "SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY" in message
    try:
        import e2b  # noqa: F401
    except ImportError:
        assert "pip install e2b" in message
    monkeypatch.setenv("SWE_SANDBOX_LIFETIME_SEC", "77")  # legacy names are read
    assert E2BSandbox("img").timeout == 77 and E2BSandbox("img", timeout=5).timeout == 5


def test_harnesses_refuse_a_missing_cli_or_tarball(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIME_AGENT_NODE_TARBALL", raising=False)
    assert ClaudeCodeHarness() is ClaudeCodeHarness()  # per-process singletons, as slime's

    async def main(harness):
        async with LocalSandbox() as sb:
            with pytest.raises(ServiceUnavailableError, match=f"not installed.*{harness.cli_tarball_env}"):
                await harness.run(sb, workdir=sb.root, session_id="s", adapter_url="http://h:1",
                                  time_budget_sec=5, prompt="fix it")
            with pytest.raises(ServiceUnavailableError, match="SLIME_AGENT_NODE_TARBALL is not set"):
                await harness.install_cli(sb)
            monkeypatch.setenv("SLIME_AGENT_NODE_TARBALL", str(tmp_path / "node.tar.xz"))
            with pytest.raises(ServiceUnavailableError, match="node.tar.xz: no such file"):
                await harness.install_cli(sb)
            monkeypatch.delenv("SLIME_AGENT_NODE_TARBALL")

    for harness in (ClaudeCodeHarness(), CodexHarness()):
        asyncio.run(main(harness))


def test_harness_command_lines_point_the_cli_at_the_adapter(monkeypatch):
    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ENVS", '{"MAX_THINKING_TOKENS": "9"}')
    ctx = HarnessContext(workdir="/w", session_id="sid-1", adapter_url="http://10.0.0.1:18001")
    cmd, env = ClaudeCodeHarness().command_and_env(ctx, "fix 'it'")
    assert cmd.startswith("/usr/local/bin/claude -p 'fix '\"'\"'it'\"'\"'' --permission-mode bypassPermissions")
    assert env["ANTHROPIC_BASE_URL"] == "http://10.0.0.1:18001" and env["ANTHROPIC_AUTH_TOKEN"] == "sid-1"
    assert env["MAX_THINKING_TOKENS"] == "9"
    cmd, env = CodexHarness().command_and_env(ctx, "go")
    assert cmd == "codex exec --skip-git-repo-check go"
    assert env == {"OPENAI_API_KEY": "sid-1", "OPENAI_BASE_URL": "http://10.0.0.1:18001/v1"}
