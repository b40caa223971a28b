"""RolloutManager as a real Ray actor: real sglang-router, two real hf engine servers, the default rollout."""

import json
import math
import os
import sys
import time
from urllib.parse import urlparse

import httpx
import psutil
import pytest
import ray
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slime.ray.rollout import RolloutManager  # noqa: E402
from slime.rollout.router import RouterClient, RouterProcess  # noqa: E402
from slime.config.arguments import parse_args  # noqa: E402
from slime.utils.types import Sample, TrainBatch  # noqa: E402

PROMPTS = [{"prompt": f"what number comes after {n}?", "label": str(n + 1)} for n in range(6)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("rollout_manager")
    model = make_tiny_model(str(root / "tiny"), size="tiny", seed=0)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"model": model, "data": str(data), "root": root}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def make_args(workdir, *extra):
    return parse_args([
        "--hf-checkpoint", workdir["model"], "--rollout-backend", "hf",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--prompt-data", workdir["data"], "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--rollout-max-response-len", "4", "--rm-type", "toy", "--advantage-estimator", "grpo",
        "--num-rollout", "1", "--sglang-server-concurrency", "8",
        *extra,
    ])  # fmt: skip


def our_servers() -> list[psutil.Process]:
    """hf engine servers and routers descending from this test process (Ray's workers are our children),
    so servers of tests running elsewhere on the machine are never counted."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
            if "slime.backends.hf_engine" in cmd or "sglang_router" in cmd or p.name() == "sglang::router":
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_no_servers(timeout: float = 20.0, exclude: tuple[int, ...] = ()) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in our_servers() if p.pid not in exclude]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def listening_pids(ports: set[int]) -> set[int]:
    return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}


@pytest.mark.timeout(240)
def test_generate_control_and_shutdown(workdir, ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    dump = str(workdir["root"] / "debug" / "rollout_{rollout_id}.pt")
    args = make_args(
        workdir, "--save-debug-rollout-data", dump,
        "--eval-prompt-data", "toy", workdir["data"], "--n-samples-per-eval-prompt", "2", "--log-passrate",
    )  # fmt: skip
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready())
    manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, (pg, [1, 0]))
    try:
        urls = ray.get(manager.get_engine_urls.remote())
        router_url = ray.get(manager.get_router_url.remote())
        assert len(urls) == 2 and len(ray.get(manager.get_engines.remote())) == 2
        assert sorted(RouterClient(router_url).list_workers()) == sorted(urls)
        assert urlparse(router_url).hostname == ray.util.get_node_ip_address()
        assert ray.get(manager.dataset_size.remote()) == len(PROMPTS)

        batch, metrics = ray.get(manager.generate.remote(0))
        assert isinstance(batch, TrainBatch) and len(batch) == 4
        assert batch.group_indices == [0, 0, 1, 1]
        assert all(1 <= n <= 4 for n in batch.response_lengths)
        assert batch.rollout_log_probs is not None
        for lps, n, toks in zip(batch.rollout_log_probs, batch.response_lengths, batch.tokens):
            assert len(lps) == n and len(toks) > n and all(math.isfinite(x) and x <= 0 for x in lps)
        for g in (0, 2):  # group-normalised: each group's rewards sum to zero
            assert batch.rewards[g] + batch.rewards[g + 1] == pytest.approx(0.0, abs=1e-6)
        assert set(batch.raw_rewards) <= {0.0, 1.0}
        assert metrics["rollout/raw_reward"] == pytest.approx(sum(batch.raw_rewards) / 4)
        assert metrics["rollout/response_len/max"] == max(batch.response_lengths)
        assert metrics["perf/rollout_time"] > 0 and metrics["rollout/failed_count"] == 0
        assert "rollout/aborted_groups" in metrics  # the default rollout's own counters are merged
        assert metrics["rollout/engine_requests/0"] == metrics["rollout/engine_requests/1"] == 2  # round robin
        assert metrics["rollout/engine_load_imbalance"] == 1.0

        saved = torch.load(dump.format(rollout_id=0), weights_only=False)
        samples = [Sample.from_dict(d) for d in saved["samples"]]
        assert saved["rollout_id"] == 0 and [s.tokens for s in samples] == batch.tokens
        assert all(s.weight_versions and set(s.weight_versions) == {"default"} for s in samples)

        # the real dump, replayed in part: int(4 x 0.5) = 2 rows, the first and the last sample
        replay = RolloutManager(make_args(workdir, "--load-debug-rollout-data", dump, "--global-batch-size", "2",
                                          "--load-debug-rollout-data-subsample", "0.5"), None)
        try:
            part, part_metrics = replay.generate(0)
        finally:
            replay.shutdown()
        assert part.tokens == [batch.tokens[0], batch.tokens[3]]
        assert part.raw_rewards == [batch.raw_rewards[0], batch.raw_rewards[3]] and part.group_indices == [0, 1]
        assert part.rewards == [0.0, 0.0]  # each group keeps one row: mean-centred to zero
        assert part_metrics["rollout/raw_reward"] == pytest.approx(sum(part.raw_rewards) / 2)

        infos = [httpx.get(u + "/server_info", timeout=10).json() for u in urls]
        assert [i["num_finished_requests"] for i in infos] == [2, 2]  # round robin over both engines

        evals = ray.get(manager.eval.remote(0))
        assert set(evals) == {"eval/toy", "eval/toy-truncated_ratio", "eval/toy-pass@1", "eval/toy-pass@2"}
        assert all(0.0 <= v <= 1.0 for v in evals.values()) and evals["eval/toy-pass@2"] >= evals["eval/toy-pass@1"]
        # the eval's samples, dumped next to the rollout's as slime names them: {rollout_id} -> eval_0
        saved = torch.load(dump.format(rollout_id="eval_0"), weights_only=False)
        eval_samples = [Sample.from_dict(d) for d in saved["samples"]]
        assert saved["rollout_id"] == 0 and len(eval_samples) == len(PROMPTS) * 2
        assert evals["eval/toy"] == pytest.approx(sum(s.reward for s in eval_samples) / len(eval_samples))
        assert all(s.response_length >= 1 and len(s.tokens) > s.response_length for s in eval_samples)

        ray.get(manager.pause_engines.remote())
        assert all(httpx.get(u + "/server_info", timeout=10).json()["paused"] for u in urls)
        ray.get(manager.continue_engines.remote())
        ray.get(manager.flush_cache.remote())
        ray.get(manager.release_memory.remote())
        assert all(httpx.get(u + "/server_info", timeout=10).json()["released_tags"] for u in urls)
        ray.get(manager.resume_memory.remote())
        assert not any(httpx.get(u + "/server_info", timeout=10).json()["paused"] for u in urls)

        ports = {urlparse(u).port for u in urls + [router_url]}
        pids = listening_pids(ports)
        assert len(pids) == 3, pids  # two engine servers and the router
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
        ray.get(manager.shutdown.remote(), timeout=60)  # idempotent
        ray.kill(manager)
        remove_placement_group(pg)
    assert not wait_no_servers(), "servers left after shutdown"
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.timeout(180)
def test_external_router_is_used_and_kept(workdir, ray_cluster, tmp_path):
    external = RouterProcess("127.0.0.1", None, log_dir=str(tmp_path)).start()
    try:
        args = make_args(
            workdir,
            "--rollout-num-gpus", "1",
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(external.port),
        )  # fmt: skip
        manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, None)
        try:
            assert ray.get(manager.get_router_url.remote()) == external.url
            [url] = ray.get(manager.get_engine_urls.remote())
            assert external.list_workers() == [url]
            batch, _ = ray.get(manager.generate.remote(0))
            assert len(batch) == 4
        finally:
            ray.get(manager.shutdown.remote(), timeout=120)
            ray.kill(manager)
        assert external.is_alive() and external.list_workers() == []  # engine deregistered, router kept
        assert not wait_no_servers(exclude=(external.pid,))
    finally:
        external.stop()
    assert not wait_no_servers(5)


@pytest.mark.timeout(120)
def test_failed_engine_start_tears_everything_down(workdir, ray_cluster):
    args = make_args(workdir)
    # parse_args refuses this value; set it afterwards so the failure happens where it would in the field:
    # in the engine servers, after the router is up
    args.sglang_server_concurrency = "not-a-number"
    manager = ray.remote(num_cpus=0)(RolloutManager).remote(args, None)
    with pytest.raises(ray.exceptions.RayActorError, match="(?s)exited with code.*not-a-number"):
        ray.get(manager.get_engines.remote(), timeout=120)
    ray.kill(manager)
    assert not wait_no_servers(), "construction failure left servers behind"


@pytest.mark.timeout(60)
def test_debug_train_only_replays_a_dump(workdir, tmp_path):
    """--debug-train-only + --load-debug-rollout-data: no router, no engine, the batch comes from the dump."""
    from slime.ray.rollout import save_debug_samples

    template = str(tmp_path / "rollout_{rollout_id}.pt")
    samples = [
        Sample(group_index=g, index=2 * g + i, tokens=[5, 6, 7, 8], response_length=2, reward=float(i),
               rollout_log_probs=[-1.0, -2.0], status=Sample.Status.COMPLETED, weight_versions=["3", "3"])
        for g in range(2) for i in range(2)
    ]  # fmt: skip
    save_debug_samples(template, 5, samples)
    args = make_args(workdir, "--debug-train-only", "--load-debug-rollout-data", template)
    before = our_servers()
    manager = RolloutManager(args, None)  # no Ray needed: nothing is started
    try:
        assert manager.get_router_url() is None and manager.get_engines() == [] and our_servers() == before
        batch, metrics = manager.generate(5)
        assert batch.tokens == [s.tokens for s in samples] and batch.raw_rewards == [0.0, 1.0, 0.0, 1.0]
        assert metrics["rollout/raw_reward"] == 0.5 and metrics["rollout/zero_std/count"] == 0
        with pytest.raises(FileNotFoundError, match="--load-debug-rollout-data"):
            manager.generate(6)
    finally:
        manager.shutdown()
