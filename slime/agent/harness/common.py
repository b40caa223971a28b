"""What every coding-agent harness shares (slime's `slime.agent.harness.common`).

A harness is a coding-agent CLI run inside a sandbox against one of the adapters: `install_cli` puts the CLI in
the sandbox, `write_config` points it at the adapter, `launch_and_wait` runs it to the end and returns its exit
code. `run()` checks the CLI is there first (`cli_path`; a missing one raises `ServiceUnavailableError` naming the
tarball variables `install_cli` reads), then creates the `agent` user, writes the config and launches.
The CLIs (claude, codex) and Node 22 come as host tarballs named by environment variables; a missing variable or
file raises `ServiceUnavailableError` naming it. Harnesses are per-process singletons (they hold no state).
"""

from __future__ import annotations

import asyncio
import json
import lzma
import os
import shlex
import shutil
import tempfile
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from slime.agent import sandbox as _sandbox
from slime.agent.sandbox import Sandbox, ServiceUnavailableError, exec_and_wait
from slime.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3
NPM_INSTALL_BACKOFF_SEC = 2.0
EXIT_UNKNOWN = -2


class SingletonABCMeta(ABCMeta, SingletonMeta):
    pass


@dataclass(frozen=True)
class HarnessContext:
    """Where the agent works and whom it talks to; `model_label` is only the name the CLI is told (the adapter
    serves whatever the engines hold)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


def host_file_from_env(var: str, what: str) -> Path:
    """The host file named by environment variable `var`, or ServiceUnavailableError saying what to set."""
    value = os.environ.get(var, "").strip()
    if not value:
        raise ServiceUnavailableError(f"{var} is not set: export the host path of {what}")
    path = Path(value)
    if not path.is_file():
        raise ServiceUnavailableError(f"{var}={value}: no such file (it should be {what})")
    return path


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    name: str = ""
    cli_path: str = ""  # the CLI's path inside the sandbox once installed
    cli_tarball_env: str = ""
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"

    @abstractmethod
    async def install_cli(self, sb: Sandbox) -> None: ...

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None: ...

    extra_args_env: str = ""  # names of the host variables adding CLI arguments / a JSON object of env vars
    extra_envs_env: str = ""

    @abstractmethod
    def base_command_and_env(self, ctx: HarnessContext, prompt: str) -> tuple[str, dict[str, str]]:
        """The CLI's command line and environment before the host's extras."""

    def command_and_env(self, ctx: HarnessContext, prompt: str) -> tuple[str, dict[str, str]]:
        """`base_command_and_env` with the arguments of `$extra_args_env` appended and `$extra_envs_env` merged."""
        cmd, env = self.base_command_and_env(ctx, prompt)
        extra = os.environ.get(self.extra_args_env, "").strip()
        extra_envs = os.environ.get(self.extra_envs_env, "").strip()
        if extra_envs:
            env.update(json.loads(extra_envs))
        return (f"{cmd} {extra}" if extra else cmd), env

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        cmd, env = self.command_and_env(ctx, prompt)
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=cmd, env=env, time_budget_sec=time_budget_sec)

    async def check_cli(self, sb: Sandbox) -> None:
        rc, _, _ = await sb.exec(f"command -v {shlex.quote(self.cli_path)}", user="root", timeout=30)
        if rc != 0:
            raise ServiceUnavailableError(
                f"{self.name}: the {self.cli_path} CLI is not installed in sandbox {sb.sandbox_id}; "
                f"{type(self).__name__}.install_cli(sb) installs it from the host tarballs named by "
                f"{self.node_tarball_env} and {self.cli_tarball_env}")

    async def run(self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: int,
                  prompt: str) -> int:
        """The agent's exit code (`EXIT_TIME_BUDGET_EXCEEDED` past the budget). The workspace is the caller's."""
        await self.check_cli(sb)
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


async def run_agent(sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int) -> int:
    """Run `start_cmd` as `agent` in `workdir`, detached, its output kept in `<workdir>/.harness/trajectory.jsonl`."""
    meta = f"{workdir}/.harness"
    await sb.exec(f"mkdir -p {meta} && chown agent:agent {meta}", user="root", check=True, timeout=30)
    code, _ = await exec_and_wait(sb, cmd=start_cmd, user="agent", env=env, workdir=workdir,
                                  out_file=f"{meta}/trajectory.jsonl", time_budget_sec=time_budget_sec, tag="run")
    return code


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path, npm_package: Path, check_cmd: str) -> None:
    """Node 22, then the CLI's npm tarball installed globally and checked with `check_cmd` (a few retries for
    transient npm failures)."""
    await install_node22(sb, node_runtime)
    await sb.write_file("/tmp/harness-cli.tgz", npm_package)
    cmd = f"npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && {check_cmd}"
    code, log = EXIT_UNKNOWN, ""
    for attempt in range(NPM_INSTALL_RETRIES):
        code, log = await exec_and_wait(sb, cmd=cmd, user="root", time_budget_sec=300, tag="harness-npm-install")
        if code == 0:
            return
        if attempt + 1 < NPM_INSTALL_RETRIES:
                await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * (attempt + 1))
    raise RuntimeError(f"npm install of {npm_package.name} failed {NPM_INSTALL_RETRIES} times (exit {code}):\n"
                       f"{log[-1000:]}")



async def install_node22(sb: Sandbox, host_tarball: Path) -> None:
    """Unpack Node 22 into /opt/node22 and link node / npm / npx into /usr/local/bin. A .xz tarball is
    decompressed on the host once (cached in the temp dir): not every image has xz."""
    host_tarball = Path(host_tarball)
    if host_tarball.suffix == ".xz":
        plain = Path(tempfile.gettempdir()) / f"slime-agent.{host_tarball.stem}"
        if not plain.exists():
            partial = plain.with_name(plain.name + ".partial")
            with lzma.open(host_tarball) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, plain)
        host_tarball = plain
    await sb.write_file("/tmp/node22.tar", host_tarball)
    await sb.exec("set -e; mkdir -p /opt/node22; tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1; "
                  "for b in node npm npx; do ln -sf /opt/node22/bin/$b /usr/local/bin/$b; done; "
                  "node --version; npm --version", user="root", timeout=180, check=True)
