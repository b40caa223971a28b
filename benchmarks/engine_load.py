"""Sustained load on `hf` engine servers behind a real sglang-router: nothing lost, memory flat.

    python benchmarks/engine_load.py [--duration 300] [--engines 2] [--per-engine 256] [--server-concurrency 64]

Starts `--engines` hf engine servers (`HFEngine`, CPU, the tiny random-init Qwen3 of tools/make_tiny_model.py)
and an sglang-router (`RouterProcess`, round robin) with the engines registered, exactly as the rollout
manager does, but without Ray. After a warm-up, an asyncio client (httpx) keeps `--per-engine` x `--engines`
`/generate` requests in flight through the router for `--duration` seconds: each of that many client tasks
sends a request (a random prompt of 8-24 token ids, `max_new_tokens` 8-16, `ignore_eos`) and sends the next
one as soon as the answer is back. Then it stops sending and waits for what is in flight.

An engine server admits `--sglang-server-concurrency` requests into its running batch (`--server-concurrency`
here); the rest wait in its queue. The router itself does not limit concurrency (`--max-concurrent-requests`
is -1 by default), so a request that is not answered is lost in our code or in the router, not rejected.

Reported (markdown table): requests sent, completed OK (HTTP 200 with the asked number of tokens), failed
(any other answer, or a transport error), lost (sent but neither), throughput, p50/p99 latency, and each
engine server's RSS (psutil, the process and all its children): after warm-up, at the end, and the maximum of
samples taken every `--sample-every` seconds; the router's RSS likewise. Every process started is reaped on
every exit path (try/finally; SIGTERM is turned into SystemExit; the servers and the router also carry
PR_SET_PDEATHSIG, so even a SIGKILLed benchmark leaves none behind).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import threading
import time

import httpx
import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from slime.backends.hf_engine.engine import HFEngine  # noqa: E402
from slime.rollout.router import RouterProcess  # noqa: E402
from tests.args import make_args  # noqa: E402


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants, in MB (0 when it is gone)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


class RssSampler(threading.Thread):
    """Samples the RSS of named process trees every `interval` seconds until stopped."""

    def __init__(self, pids: dict[str, int], interval: float):
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self._stop_event = threading.Event()

    def sample(self) -> dict[str, float]:
        now = time.monotonic()
        out = {}
        for name, pid in self.pids.items():
            out[name] = tree_rss_mb(pid)
            self.samples[name].append((now, out[name]))
        return out

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


class LoadStats:
    def __init__(self):
        self.sent = 0
        self.ok = 0
        self.failed = 0
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


async def client_task(client: httpx.AsyncClient, url: str, stop_at: float, stats: LoadStats, rng: random.Random,
                      vocab: int) -> None:
    while time.monotonic() < stop_at:
        n_new = rng.randint(8, 16)
        body = {"input_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(8, 24))],
                "sampling_params": {"temperature": 1.0, "max_new_tokens": n_new, "ignore_eos": True}}
        stats.sent += 1
        start = time.monotonic()
        try:
            resp = await client.post(url, json=body)
        except httpx.HTTPError as e:
            stats.fail(type(e).__name__)
            continue
        if resp.status_code != 200:
            stats.fail(f"HTTP {resp.status_code}: {resp.text[:120]}")
            continue
        try:
            got = len(resp.json()["output_ids"])
        except (ValueError, KeyError, TypeError):
            stats.fail("malformed body")
            continue
        if got != n_new:
            stats.fail(f"{got} tokens instead of {n_new}")
            continue
        stats.ok += 1
        stats.latencies.append(time.monotonic() - start)


async def drive(router_url: str, concurrency: int, duration: float, drain_timeout: float, vocab: int,
                seed: int) -> tuple[LoadStats, float, int]:
    """Returns the stats, the wall time of the load (first send to last answer) and the tasks still running
    after the drain timeout (their requests count as lost)."""
    stats = LoadStats()
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(drain_timeout + duration),
                                 trust_env=False) as client:
        start = time.monotonic()
        stop_at = start + duration
        tasks = [asyncio.create_task(client_task(client, router_url + "/generate", stop_at, stats,
                                                 random.Random(seed * 100_003 + i), vocab))
                 for i in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=duration + drain_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                stats.fail(f"client task crashed: {t.exception()!r}")
        return stats, time.monotonic() - start, len(pending)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def report(args, stats: LoadStats, wall: float, stuck: int, rss_start: dict, rss_end: dict, sampler: RssSampler,
           engine_info: list[dict]) -> str:
    lost = stats.sent - stats.ok - stats.failed
    lines = [
        f"{args.engines} hf engines (CPU, tiny Qwen3, --sglang-server-concurrency {args.server_concurrency}) behind "
        f"sglang-router, {args.per_engine * args.engines} requests in flight, {args.duration:.0f} s",
        "",
        "| requests sent | completed OK | failed | lost | throughput req/s | p50 latency s | p99 latency s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {stats.sent} | {stats.ok} | {stats.failed} | {lost} | {stats.ok / wall:.1f} "
        f"| {percentile(stats.latencies, 50):.2f} | {percentile(stats.latencies, 99):.2f} |",
        "",
        "| process | RSS MB after warm-up | RSS MB at end | max RSS MB | requests finished | largest batch |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in sampler.pids:
        peak = max((v for _, v in sampler.samples[name]), default=float("nan"))
        info = engine_info[int(name.split()[-1])] if name.startswith("engine") else {}
        lines.append(f"| {name} | {rss_start[name]:.0f} | {rss_end[name]:.0f} | {peak:.0f} "
                     f"| {info.get('num_finished_requests', '-')} | {info.get('max_batch_size_seen', '-')} |")
    if stats.errors:
        lines += ["", "failures: " + ", ".join(f"{k} x{v}" for k, v in sorted(stats.errors.items()))]
    if stuck:
        lines += ["", f"{stuck} client tasks were still waiting for an answer after the drain timeout"]
    return "\n".join(lines)


def rss_trend(sampler: RssSampler, every_s: float = 60.0) -> str:
    """One RSS value per engine per `every_s` seconds: a steady climb would show here."""
    out = []
    for name, samples in sampler.samples.items():
        if not samples:
            continue
        marks, next_t = [], samples[0][0]
        for t, v in samples:
            if t >= next_t:
                marks.append(f"{v:.0f}")
                next_t += every_s
        out.append(f"  {name}: " + " ".join(marks))
    return f"RSS MB every {every_s:.0f} s:\n" + "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of sustained load")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--per-engine", type=int, default=256, help="requests kept in flight per engine")
    parser.add_argument("--server-concurrency", type=int, default=64,
                        help="--sglang-server-concurrency: the largest running batch of each engine")
    parser.add_argument("--sample-every", type=float, default=3.0, help="seconds between RSS samples")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds to wait for in-flight requests after the load stops")
    parser.add_argument("--workdir", default=None, help="model and logs (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="slime_engine_load_")
    os.makedirs(workdir, exist_ok=True)
    os.environ.setdefault("SLIME_ENGINE_LOG_DIR", os.path.join(workdir, "logs"))
    os.environ.setdefault("SLIME_ENGINE_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from tools.make_tiny_model import make_tiny_model

    model_dir = make_tiny_model(os.path.join(workdir, "tiny-qwen3"), size="tiny", seed=0)
    with open(os.path.join(model_dir, "config.json")) as f:
        import json

        vocab = json.load(f)["vocab_size"]

    engines: list[HFEngine] = []
    router: RouterProcess | None = None
    sampler: RssSampler | None = None
    try:
        for rank in range(args.engines):
            engine = HFEngine(make_args(hf_checkpoint=model_dir, rollout_seed=args.seed,
                                        sglang_server_concurrency=args.server_concurrency), rank=rank)
            engines.append(engine)
            engine.init()  # main thread: PDEATHSIG ties the server to this process
        router = RouterProcess("127.0.0.1", None, log_dir=os.path.join(workdir, "logs")).start()
        for engine in engines:
            router.add_worker(engine.get_url())
        print(f"router {router.url}, engines {[e.get_url() for e in engines]}, logs {workdir}/logs", flush=True)

        warm, _, _ = asyncio.run(drive(router.url, 2 * args.engines, 5.0, 60.0, vocab, args.seed + 1))
        if warm.ok == 0 or warm.failed:
            raise SystemExit(f"warm-up failed: {warm.errors}")
        pids = {f"engine {i}": e.process.pid for i, e in enumerate(engines)}
        pids["router"] = router.pid
        sampler = RssSampler(pids, args.sample_every)
        rss_start = sampler.sample()
        sampler.start()
        print(f"warm-up: {warm.ok} requests; load: {args.per_engine * args.engines} in flight for "
              f"{args.duration:.0f} s", flush=True)
        stats, wall, stuck = asyncio.run(drive(router.url, args.per_engine * args.engines, args.duration,
                                               args.drain_timeout, vocab, args.seed))
        sampler.stop()
        rss_end = sampler.sample()
        engine_info = [e.get_server_info() for e in engines]
        table = report(args, stats, wall, stuck, rss_start, rss_end, sampler, engine_info)
        print(table)
        print(rss_trend(sampler))
        with open(os.path.join(workdir, "table.md"), "w") as f:
            f.write(table + "\n")
        print(f"(written to {os.path.join(workdir, 'table.md')})")
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        if router is not None:
            router.stop()
        for engine in engines:
            engine.shutdown()


if __name__ == "__main__":
    main()
