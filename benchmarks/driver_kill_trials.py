"""SIGKILL the `train.py` driver in generation, training or checkpoint saving; check nothing is left behind,
the checkpoint folder is consistent, and `--load` resumes where it should.

    python benchmarks/driver_kill_trials.py [--phases generation,training,saving,generation,training,saving]
                                            [--num-rollout 8] [--seed 0] [extra train flags]

The job is the toy GRPO job of scripts/run-tiny-cpu.sh (tiny random-init Qwen3, one fsdp rank, one hf
engine, CPU) with `--save DIR --save-interval 1 --use-tensorboard`. Each trial:

1. starts `python train.py` in a session of its own and with a unique marker in its environment (inherited by
   every process of the run: Ray's daemons and workers, the engine server, the router; the marker finds those
   that start sessions of their own, the session id those that wipe their environment, Ray's agents);
2. picks a rollout k at random and kills the driver (SIGKILL, nothing of it runs again) in the asked phase
   of rollout k. Phases are read from the outside: the engine's `/server_info` (requests running or waiting:
   generation; `weight_version`: the push count, so which rollout the run is in), and the
   checkpoint folder (`iter_000000k` appears: saving). `training` is a random point between the end of
   rollout k's generation and the appearance of its checkpoint folder, scaled by that gap in rollout k-1.
   The phase is confirmed at the moment of the kill and reported as seen then;
3. waits up to `--grace` seconds for every process of the run to exit and reports what is left, then up to
   `--linger` seconds for those (reported: when the last one went), SIGKILLing by pid what is still there;
4. checks the checkpoint folder: `latest_checkpointed_iteration.txt` names rollout L and `iter_L` is complete
   (HF config + safetensors, `trainer_state.json` with that rollout id, the optimizer's DCP `.metadata`)
   and the data source state `rollout/data_source_state_L.json` is there;
5. resumes with the same flags plus `--load DIR` (a fresh TensorBoard dir), and checks that it exits 0,
   starts at L + 1 (its first TensorBoard step) and that its TensorBoard steps are exactly L+1 .. N-1, while
   the killed run's cover 0 .. L: together the curve has neither gap nor overlap.

Torch threads: SLIME_TRAIN_NUM_THREADS=SLIME_ENGINE_NUM_THREADS=OMP_NUM_THREADS=1 unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from slime.utils.tracking import read_scalars  # noqa: E402
from sync_vs_async import job_flags as toy_job_flags  # noqa: E402

MARKER_VAR = "SLIME_KILL_TRIAL_MARKER"
LATEST_FILE = "latest_checkpointed_iteration.txt"
PHASES = ("generation", "training", "saving")
POLL_S = 0.02


def job_flags(args, model_dir: str, data_path: str, save_dir: str) -> list[str]:
    """The toy job of scripts/run-tiny-cpu.sh as benchmarks/sync_vs_async.py runs it, with a checkpoint after
    every rollout."""
    return [*toy_job_flags(args, model_dir, data_path), "--train-backend", "fsdp",
            "--save", save_dir, "--save-interval", "1", "--use-tensorboard"]


def marked_processes(marker: str, sessions: set[int]) -> dict[int, str]:
    """Live processes (zombies excluded) of one run: pid -> command line. A process belongs to the run when its
    environment carries the run's marker, or when it is in the run's session (the drivers are started with
    start_new_session, so the session id is a driver's pid). Both are needed: Ray's agents overwrite their
    environment when they retitle themselves (`ray::DashboardAgent`), and the engine servers and the router
    start sessions of their own."""
    me, found = os.getpid(), {}
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if p.info["pid"] == me or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(p.info["pid"]) in sessions or p.environ().get(MARKER_VAR) == marker:
                found[p.info["pid"]] = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "?")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
            continue
    return found


def kill_all(procs: dict[int, str]) -> None:
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def short_name(cmd: str) -> str:
    for key, name in (("slime.backends.hf_engine", "hf-engine"), ("sglang", "router"), ("raylet", "raylet"),
                      ("gcs_server", "gcs_server"), ("ray::", None), ("train.py", "train.py")):
        if key in cmd:
            return name or cmd.split()[0]
    return os.path.basename(cmd.split()[0]) if cmd else "?"


class RunWatcher:
    """What a running job is doing, seen from outside: engine load and weight version, checkpoint folder."""

    def __init__(self, engine_log_dir: str, save_dir: str):
        self.engine_log_dir, self.save_dir = engine_log_dir, save_dir
        self.url: str | None = None
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    def engine_url(self) -> str | None:
        if self.url is None and os.path.isdir(self.engine_log_dir):
            for name in os.listdir(self.engine_log_dir):
                with open(os.path.join(self.engine_log_dir, name), errors="replace") as f:
                    first = f.readline()
                host, port = re.search(r"--host (\S+)", first), re.search(r"--port (\d+)", first)
                if host and port:
                    self.url = f"http://{host.group(1)}:{port.group(1)}"
        return self.url

    def engine_state(self) -> tuple[int | None, int]:
        """(weight version as an int, or None before the first push / when unreachable; requests in the engine)."""
        url = self.engine_url()
        if url is None:
            return None, 0
        try:
            info = self.http.get(url + "/server_info").json()
            version, load = info["weight_version"], info["num_running_reqs"] + info["num_waiting_reqs"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None, 0
        return (int(version) if str(version).isdigit() else None), int(load)

    def has_iter(self, k: int) -> bool:
        return os.path.isdir(os.path.join(self.save_dir, f"iter_{k:07d}"))

    def latest(self) -> int | None:
        try:
            with open(os.path.join(self.save_dir, LATEST_FILE)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        self.http.close()


def kill_in_phase(proc: subprocess.Popen, watch: RunWatcher, phase: str, k: int, last: int, rng: random.Random,
                  start: float, timeout: float) -> dict:
    """Follow the run until rollout `k` is in `phase`, then SIGKILL the driver. The point inside the phase is
    random, scaled by how long the same phase took in the rollout before; when rollout k's phase passes
    before that point (they last a second or so), the next rollout is the target, up to rollout `last`."""
    deadline = time.monotonic() + timeout
    gen_start: dict[int, float] = {}  # rollout -> when the engine was first seen busy with it
    gen_end: dict[int, float] = {}  # rollout -> when its generation was seen to end
    iter_seen: dict[int, float] = {}  # rollout -> when its checkpoint folder appeared
    kill_at: float | None = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"train.py exited with {proc.returncode} before the kill ({phase}, rollout {k})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout {k} never reached phase {phase} within {timeout:.0f} s")
        version, load = watch.engine_state()
        now = time.monotonic()
        rollout = None if version is None else version - 1  # push v precedes rollout v-1
        if rollout is not None:
            if load > 0:
                gen_start.setdefault(rollout, now)
            elif rollout in gen_start and rollout not in gen_end:
                gen_end[rollout] = now
        for j in range(max(0, k - 1), k + 1):
            if j not in iter_seen and watch.has_iter(j):
                iter_seen[j] = now

        missed = False
        if phase == "generation" and rollout == k and load > 0:
            if kill_at is None:
                prev = gen_end.get(k - 1, 0.0) - gen_start.get(k - 1, 0.0)
                kill_at = gen_start[k] + rng.uniform(0.1, 0.6) * prev
            if now >= kill_at:
                break
        elif phase == "generation":
            missed = k in gen_end or (rollout is not None and rollout > k)
        elif phase == "training" and k in gen_end and k not in iter_seen:
            if kill_at is None:
                prev = iter_seen.get(k - 1, 0.0) - gen_end.get(k - 1, 0.0)
                kill_at = gen_end[k] + rng.uniform(0.1, 0.6) * (prev if prev > 0 else 0.5)
            if now >= kill_at:
                break
        elif phase == "training":
            missed = k in iter_seen
        elif phase == "saving" and k in iter_seen:
            break
        if missed:
            if k >= last:
                raise RuntimeError(f"missed the {phase} phase of every rollout up to {last}")
            k, kill_at = k + 1, None
        time.sleep(POLL_S)
    os.kill(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    version, load = watch.engine_state()
    latest = watch.latest()
    # What the run was doing at the kill, as far as the outside can tell.
    if watch.has_iter(k) and (latest is None or latest < k):
        seen = "saving"
    elif load > 0:
        seen = "generation"
    elif not watch.has_iter(k):
        seen = "training"
    else:
        seen = "after save"
    proc.wait()
    return {"rollout": k, "seconds": seconds, "seen": seen, "latest_at_kill": latest}


def checkpoint_status(save_dir: str) -> tuple[int | None, str, str]:
    """(latest rollout, 'yes' or what the iteration folder lacks, 'yes' or 'no': its data source state) of the
    folder `--load` will read."""
    try:
        with open(os.path.join(save_dir, LATEST_FILE)) as f:
            latest = int(f.read().strip())
    except FileNotFoundError:
        return None, "no checkpoint", "-"
    path = os.path.join(save_dir, f"iter_{latest:07d}")
    missing = [name for name in ("config.json", "trainer_state.json", "optimizer/.metadata")
               if not os.path.isfile(os.path.join(path, name))]
    if not any(n.endswith(".safetensors") for n in (os.listdir(path) if os.path.isdir(path) else [])):
        missing.append("*.safetensors")
    if "trainer_state.json" not in missing:
        with open(os.path.join(path, "trainer_state.json")) as f:
            if json.load(f).get("rollout_id") != latest:
                missing.append("trainer_state rollout_id")
    data_state = os.path.isfile(os.path.join(save_dir, "rollout", f"data_source_state_{latest}.json"))
    return latest, "yes" if not missing else "no: " + ", ".join(missing), "yes" if data_state else "no"


def tb_continuity(killed: set[int], resumed: list[int], start: int, num_rollout: int) -> str:
    """'yes' when the resumed run logged exactly start .. N-1 and the killed run 0 .. start-1; else the gaps
    and overlaps of the two runs' steps together."""
    if resumed == list(range(start, num_rollout)) and set(range(start)) <= killed:
        return "yes"
    logged = killed | set(resumed)
    gap = sorted(set(range(num_rollout)) - logged)
    overlap = sorted(set(resumed) & killed)
    extra = sorted(s for s in resumed if s < start)
    parts = [f"gap at {gap}" if gap else "", f"overlap at {overlap}" if overlap else "",
             f"resumed run logged {extra} before its start" if extra else ""]
    return "no: " + "; ".join(p for p in parts if p) + f" (killed run {sorted(killed)}, resumed {resumed})"


def run_trial(i: int, phase: str, args, extra: list[str], workdir: str, rng: random.Random) -> dict:
    trial_dir = os.path.join(workdir, f"trial{i}")
    os.makedirs(trial_dir, exist_ok=True)
    save_dir, engine_logs = os.path.join(trial_dir, "ckpt"), os.path.join(trial_dir, "engine_logs")
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, SLIME_ENGINE_LOG_DIR=engine_logs, SLIME_LOG_DIR=trial_dir)
    env[MARKER_VAR] = marker
    for var in ("SLIME_TRAIN_NUM_THREADS", "SLIME_ENGINE_NUM_THREADS", "OMP_NUM_THREADS"):
        env.setdefault(var, "1")
    env.pop("RAY_ADDRESS", None)
    base = [sys.executable, os.path.join(REPO_ROOT, "train.py"),
            *job_flags(args, args.model_dir, args.data, save_dir), *extra]
    k = rng.randint(1, args.num_rollout - 3)
    result = {"trial": i, "phase": phase}
    print(f"[trial {i}] kill in {phase} of rollout {k} (dir {trial_dir})", flush=True)

    sessions: set[int] = set()  # the drivers' pids
    try:
        return _trial_steps(i, k, result, base, env, marker, sessions, trial_dir, save_dir, engine_logs, args, rng)
    finally:  # also on Ctrl-C or an error: nothing of this trial may outlive it
        kill_all(marked_processes(marker, sessions))


def _trial_steps(i, k, result, base, env, marker, sessions, trial_dir, save_dir, engine_logs, args, rng) -> dict:
    watch = RunWatcher(engine_logs, save_dir)
    start = time.monotonic()
    with open(os.path.join(trial_dir, "killed.log"), "w") as log:
        proc = subprocess.Popen([*base, "--tensorboard-dir", os.path.join(trial_dir, "tb_killed")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=trial_dir, start_new_session=True)
    sessions.add(proc.pid)
    try:
        result.update(kill_in_phase(proc, watch, result["phase"], k, args.num_rollout - 2, rng, start,
                                    args.kill_timeout))
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # Everything of the run must follow the driver within the grace period; then we wait for the rest to go.
    killed_at = time.monotonic()
    while (left := marked_processes(marker, sessions)) and time.monotonic() < killed_at + args.grace:
        time.sleep(0.5)
    result["leftover"] = sorted(short_name(c) for c in left.values())
    if left:
        print(f"[trial {i}] left {args.grace:.0f} s after the kill: "
              + "; ".join(f"{p}: {c[:120]}" for p, c in left.items()), flush=True)
    while (still := marked_processes(marker, sessions)) and time.monotonic() < killed_at + args.linger:
        time.sleep(0.5)
    result["gone_after_s"] = None if still else round(time.monotonic() - killed_at, 1)
    if still:
        print(f"[trial {i}] still there {args.linger:.0f} s after the kill, SIGKILLed: {still}", flush=True)
        kill_all(still)

    result["latest"], result["complete"], result["data_state"] = checkpoint_status(save_dir)
    latest = result["latest"]

    # Resume with the same flags.
    resume_tb = os.path.join(trial_dir, "tb_resumed")
    with open(os.path.join(trial_dir, "resumed.log"), "w") as log:
        resumed = subprocess.Popen([*base, "--load", save_dir, "--tensorboard-dir", resume_tb], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=trial_dir, start_new_session=True)
        sessions.add(resumed.pid)
        try:
            result["resume_rc"] = resumed.wait(args.resume_timeout)
        finally:
            if resumed.poll() is None:
                resumed.kill()
                resumed.wait()
    killed_steps = set(read_scalars(os.path.join(trial_dir, "tb_killed"), "rollout/raw_reward"))
    resumed_steps = sorted(read_scalars(resume_tb, "rollout/raw_reward"))
    expected_start = 0 if latest is None else latest + 1
    result["resumed_at"] = resumed_steps[0] if resumed_steps else None
    result["expected_start"] = expected_start
    result["tb"] = tb_continuity(killed_steps, resumed_steps, expected_start, args.num_rollout)
    time.sleep(2)
    result["leftover_after_resume"] = sorted(short_name(c) for c in marked_processes(marker, sessions).values())
    print(f"[trial {i}] {result}", flush=True)
    return result


def report(results: list[dict]) -> str:
    lines = [
        "| trial | kill phase (asked / seen) | rollout | s after start | latest ckpt | leftover after grace "
        "| ckpt complete? | its data source state? | resumed at (expected) | resumed rc | TB steps continuous? |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- | ---: | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['trial']} | {r['phase']} | - | - | - | - | - | - | - | - | error: {r['error']} |")
            continue
        gone = (f"all gone {r['gone_after_s']} s after the kill" if r["gone_after_s"] is not None
                else "SIGKILLed by the benchmark")
        leftover = f"{', '.join(r['leftover'])} ({gone})" if r["leftover"] else f"none ({gone})"
        if r["leftover_after_resume"]:
            leftover += f"; after the resumed run: {', '.join(r['leftover_after_resume'])}"
        latest = "-" if r["latest"] is None else str(r["latest"])
        lines.append(
            f"| {r['trial']} | {r['phase']} / {r['seen']} | {r['rollout']} | {r['seconds']:.1f} | {latest} "
            f"| {leftover} | {r['complete']} | {r['data_state']} | {r['resumed_at']} ({r['expected_start']}) "
            f"| {r['resume_rc']} | {r['tb']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="generation,training,saving,generation,training,saving",
                        help=f"one trial per entry, from {PHASES}")
    parser.add_argument("--num-rollout", type=int, default=8)
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per rollout (x8 samples)")
    parser.add_argument("--max-response-len", type=int, default=32, help="longer: wider phases to land a kill in")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds the run's processes get to exit")
    parser.add_argument("--linger", type=float, default=120.0,
                        help="seconds to wait for what outlived the grace period before SIGKILLing it")
    parser.add_argument("--kill-timeout", type=float, default=900.0)
    parser.add_argument("--resume-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=os.path.join(REPO_ROOT, "models", "tiny-qwen3"))
    parser.add_argument("--data", default=os.path.join(REPO_ROOT, "data", "toy_train.jsonl"))
    parser.add_argument("--workdir", default=None, help="trial folders (default: a temp dir)")
    args, extra = parser.parse_known_args()

    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"--phases {args.phases!r}: each entry must be one of {PHASES}")
    if args.num_rollout < 3:
        parser.error(f"--num-rollout {args.num_rollout}: needs at least 3 (a kill in rollout 1 .. N-2)")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        from tools.make_tiny_model import make_tiny_model

        make_tiny_model(args.model_dir, size="tiny", seed=0)
    if not os.path.isfile(args.data):
        from tools.make_toy_data import write_toy_data

        write_toy_data(args.data, num_samples=20000, seed=0)
    args.model_dir, args.data = os.path.abspath(args.model_dir), os.path.abspath(args.data)

    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="slime_driver_kill_"))
    os.makedirs(workdir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    rng = random.Random(args.seed)
    results = []
    for i, phase in enumerate(phases):
        try:
            results.append(run_trial(i, phase, args, extra, workdir, rng))
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
            print(f"[trial {i}] failed: {e}", flush=True)
            results.append({"trial": i, "phase": phase, "error": str(e)[:200]})
    table = report(results)
    print(table)
    with open(os.path.join(workdir, "table.md"), "w") as f:
        f.write(table + "\n")
    print(f"(written to {os.path.join(workdir, 'table.md')}; logs per trial under {workdir})")


if __name__ == "__main__":
    main()
