"""Sandboxes an agent works in (slime's `slime.agent.sandbox`).

`Sandbox` is the contract the harnesses and the SWE task code use: an async context manager with `exec`,
`write_file` and `read_file`. Two implementations:

- `E2BSandbox` (slime's): a remote sandbox from the e2b service, booted from the task's image. It needs the `e2b`
  package, `E2B_API_KEY` and the gateway's image metadata key (`SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY`); when one
  is missing, entering it raises `ServiceUnavailableError` naming each. Not exercised here (no e2b service).
- `LocalSandbox` (ours): a temporary folder on this host and `bash -c` subprocesses, for development and tests.
  It is no isolation: commands run as the current user (`user=` is ignored, `ensure_agent_user` does nothing for
  it), with the folder as working directory and `HOME`, its `tmp/` as `TMPDIR` (and `exec_and_wait`'s scratch
  folder, instead of /tmp); a relative path is taken inside the folder, an
  absolute one as is. A command past its `timeout` has its whole process group killed and raises
  `TimeoutError`; leaving the context kills every process any of its commands started (detached ones too, found
  by a marker in their environment) and removes the folder.

`exec_and_wait` runs a long command detached and polls for its exit code (on E2B a single `exec` stream would be
cut by the gateway long before a test suite ends).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Protocol, runtime_checkable

import psutil

logger = logging.getLogger(__name__)

ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path

EXIT_TIME_BUDGET_EXCEEDED = -1


class ServiceUnavailableError(RuntimeError):
    """An outside service (or the package / key / CLI it needs) is missing; the message names each and the fix."""


@runtime_checkable
class Sandbox(Protocol):
    """`exec` returns (exit code, stdout, stderr); with `check=True` a non-zero exit raises. `idempotent` tells a
    backend that retries transport failures whether sending the command again is safe."""

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type, exc, tb) -> None: ...

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


async def exec_and_wait(sb: Sandbox, *, cmd: str, time_budget_sec: int, tag: str, user: str = "root",
                        env: dict[str, str] | None = None, workdir: str | None = None, out_file: str | None = None,
                        want_output: bool = False, poll_sec: float = 5.0) -> tuple[int, str]:
    """Run `cmd` detached (`setsid`, output to `out_file`, exit code to a marker file) and poll the marker with
    short commands until it appears or `time_budget_sec` passes (then `EXIT_TIME_BUDGET_EXCEEDED`).
    Returns (exit code, the whole output if `want_output`, else the last 512 bytes of it on failure)."""
    # a sandbox sharing the host's /tmp (LocalSandbox) names its own scratch folder
    tmp = getattr(sb, "tmp_dir", "/tmp")
    out_file = out_file or f"{tmp}/.{tag}.out"
    done, launcher, spawned = f"{tmp}/.{tag}.done", f"{tmp}/.{tag}.sh", f"{tmp}/.{tag}.spawned"
    cd = f"cd {workdir}\nexport HOME=/home/{user}\n" if workdir else ""
    await sb.write_file(launcher, f"#!/bin/bash\n{cd}{cmd}\necho $? > {done}\n", user=user)
    # the previous run of this tag is cleared first; the mkdir guard then only stops a retried spawn of this run
    await sb.exec(f"rm -rf {spawned}; rm -f {out_file} {done}", user=user, timeout=30, check=True)
    await sb.exec(f"chmod +x {launcher}; mkdir {spawned} 2>/dev/null || exit 0; "
                  f"setsid bash {launcher} < /dev/null > {out_file} 2>&1 &", user=user, env=env, timeout=30, check=True)
    deadline = time.monotonic() + time_budget_sec
    code = EXIT_TIME_BUDGET_EXCEEDED
    while time.monotonic() < deadline:
        await asyncio.sleep(poll_sec)
        rc, out, _ = await sb.exec(f"test -f {done} && cat {done}", user=user, timeout=15)
        if rc == 0 and out.strip():
            code = int(out.strip())
            break
    if want_output:
        return code, await sb.read_file(out_file, user=user)
    if code == 0:
        return code, ""
    _, tail, _ = await sb.exec(f"tail -c 512 {out_file} 2>/dev/null", user=user, timeout=15)
    return code, tail


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """Create the unprivileged `agent` user owning `workdir` (and able to `git diff` there). A LocalSandbox has no
    users of its own, so nothing is done for it (the host's accounts are not touched)."""
    if isinstance(sb, LocalSandbox):
        return
    await sb.exec(f"id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && "
                  f"chown -R agent:agent /home/agent {workdir} && "
                  f"git config --system --add safe.directory '*' && id agent", user="root", check=True, timeout=60)


def _getenv(*names: str, default: str = "") -> str:
    """The first of `names` set to a non-blank value (canonical name first, legacy ones after)."""
    return next((os.environ[n] for n in names if os.environ.get(n, "").strip()), default)


class LocalSandbox:
    """A temporary folder and subprocesses on this host behind the Sandbox contract (see the module docstring)."""

    def __init__(self, image: str | None = None, *, root: str | None = None, keep: bool = False):
        self.image = image  # accepted for interface parity; a local sandbox has no image
        self._given_root = root
        self.keep = keep
        self.root = ""
        self.tmp_dir = ""
        self.sandbox_id = f"local-{uuid.uuid4().hex[:12]}"

    def _path(self, p: str) -> Path:
        return Path(p) if os.path.isabs(p) else Path(self.root) / p

    async def __aenter__(self) -> LocalSandbox:
        self.root = self._given_root or tempfile.mkdtemp(prefix=f"slime-{self.sandbox_id}-")
        self.tmp_dir = os.path.join(self.root, "tmp")
        os.makedirs(self.tmp_dir, exist_ok=True)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.kill_all()
        if not self.keep and not self._given_root and self.root:
            shutil.rmtree(self.root, ignore_errors=True)

    def processes(self) -> list[psutil.Process]:
        """Live processes started by this sandbox's commands, detached ones included."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("SLIME_LOCAL_SANDBOX_ID") == self.sandbox_id:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def kill_all(self) -> None:
        procs = self.processes()
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult:
        if not self.root:
            raise RuntimeError("LocalSandbox.exec outside `async with LocalSandbox() as sb:`")
        full_env = {**os.environ, "HOME": self.root, "TMPDIR": self.tmp_dir, **(env or {}),
                    "SLIME_LOCAL_SANDBOX_ID": self.sandbox_id}
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", cmd, cwd=self.root, env=full_env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TimeoutError(f"{self.sandbox_id}: {cmd[:120]!r} ran past its timeout of {timeout}s; its process "
                               f"group was killed") from None
        rc, stdout, stderr = proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
        if check and rc != 0:
            raise RuntimeError(f"{self.sandbox_id}: {cmd[:120]!r} exited {rc}: {stderr[-400:]}")
        return rc, stdout, stderr

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        path = self._path(sandbox_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text, or "" when it cannot be read (as E2BSandbox answers)."""
        try:
            return self._path(sandbox_path).read_text(errors="replace")
        except OSError:
            return ""


class E2BSandbox:
    """A remote e2b sandbox booted from `image` (routed by the gateway's image metadata key). Settings come from
    the arguments, else the environment (`SLIME_AGENT_*`, legacy `SWE_*` names accepted)."""

    image_metadata_key_env = ("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY")
    lifetime_sec_env = ("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "SWE_SANDBOX_LIFETIME_SEC")
    rpc_retries_env = ("SLIME_AGENT_SANDBOX_RPC_RETRIES", "SWE_RPC_RETRIES")
    size_env = ("SLIME_AGENT_E2B_SANDBOX_SIZE", "SWE_E2B_SANDBOX_SIZE")
    default_lifetime_sec = 3600
    default_rpc_retries = 6
    default_size = "md"
    rpc_backoff_base_sec, rpc_backoff_cap_sec = 1.0, 32.0
    # client-side failures after which the call can be sent again
    transient_errors = frozenset({"ProtocolError", "LocalProtocolError", "WriteError", "ReadError", "ConnectError",
                                  "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout",
                                  "RemoteProtocolError", "SSLError"})

    def __init__(self, image: str, *, timeout: int | None = None, image_metadata_key: str | None = None,
                 rpc_retries: int | None = None, size: str | None = None):
        self.image = image
        self.timeout = timeout if timeout is not None else int(
            _getenv(*self.lifetime_sec_env, default=str(self.default_lifetime_sec)))
        self.image_metadata_key = image_metadata_key or _getenv(*self.image_metadata_key_env) or None
        self.rpc_retries = rpc_retries if rpc_retries is not None else int(
            _getenv(*self.rpc_retries_env, default=str(self.default_rpc_retries)))
        self.size = size if size is not None else _getenv(*self.size_env, default=self.default_size)
        self._sb = None
        self.sandbox_id = ""

    @staticmethod
    def missing_requirements(image_metadata_key: str | None) -> list[str]:
        """What this host lacks to boot an e2b sandbox, one fix per line (empty: nothing)."""
        missing = []
        try:
            import e2b  # noqa: F401
        except ImportError:
            missing.append("the `e2b` package: `pip install e2b`")
        if not os.environ.get("E2B_API_KEY", "").strip():
            missing.append("E2B_API_KEY: export your e2b key (a gateway that ignores auth still needs "
                           "`e2b_` + 40 hex characters)")
        if not image_metadata_key:
            missing.append("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY: export the metadata key your e2b gateway routes "
                           "images by (e.g. `image`)")
        return missing

    def _is_transient(self, e: BaseException) -> bool:
        if type(e).__name__ in self.transient_errors:
            return True
        return type(e).__name__ == "SandboxException" and not any(
            s in str(e) for s in ("does not exist", "STOPPED state"))

    async def _retry(self, what: str, call, *, idempotent: bool = True):
        for attempt in range(self.rpc_retries):
            try:
                return await call()
            except Exception as e:
                if not idempotent or not self._is_transient(e) or attempt + 1 == self.rpc_retries:
                    raise
                delay = random.uniform(0, min(self.rpc_backoff_cap_sec, self.rpc_backoff_base_sec * 2 ** attempt))
                logger.debug("e2b %s: %s, retry %d/%d in %.1fs", what, type(e).__name__, attempt + 1,
                             self.rpc_retries, delay)
                await asyncio.sleep(delay)

    async def __aenter__(self) -> E2BSandbox:
        missing = self.missing_requirements(self.image_metadata_key)
        if missing:
            raise ServiceUnavailableError(
                f"E2BSandbox({self.image!r}) needs the e2b sandbox service, and this host lacks:\n  - "
                + "\n  - ".join(missing) + "\n(LocalSandbox runs commands on this host instead, for development)")
        from e2b import AsyncSandbox

        metadata = {self.image_metadata_key: self.image}
        if self.size:
            prefix = self.image_metadata_key.rpartition("/")[0]
            metadata[f"{prefix}/size" if prefix else "size"] = self.size
        self._sb = await self._retry("create", lambda: AsyncSandbox.create(timeout=self.timeout, metadata=metadata))
        self.sandbox_id = self._sb.sandbox_id
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._sb is not None:
            try:
                await self._sb.kill()
            except Exception as e:  # noqa: BLE001 - the service reclaims it at its lifetime anyway
                logger.warning("e2b sandbox %s: kill failed: %s", self.sandbox_id, e)

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult:
        from e2b.sandbox.commands.command_handle import CommandExitException

        try:
            res = await self._retry(f"exec {cmd[:60]!r}", lambda: self._sb.commands.run(
                cmd, user=user, envs=env, timeout=timeout, on_stdout=lambda s: None, on_stderr=lambda s: None),
                idempotent=idempotent)
            return res.exit_code, res.stdout or "", res.stderr or ""
        except CommandExitException as e:
            if check:
                raise RuntimeError(f"e2b {self.sandbox_id}: {cmd[:120]!r} exited {e.exit_code}: "
                                   f"{(e.stderr or '')[-400:]}") from None
            return e.exit_code, e.stdout or "", e.stderr or ""

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        if isinstance(content, Path):
            data = content.read_bytes()
        elif isinstance(content, bytes):
            data = content
        else:
            await self._retry(f"write {sandbox_path}", lambda: self._sb.files.write(sandbox_path, content, user=user))
            return
        await self._retry(f"write {sandbox_path}", lambda: self._sb.files.write(
            sandbox_path, io.BytesIO(data), user=user, request_timeout=600))

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        try:
            return await self._retry(f"read {sandbox_path}", lambda: self._sb.files.read(sandbox_path, user=user))
        except Exception:  # noqa: BLE001 - a missing file reads as "" (callers test for it)
            return ""
