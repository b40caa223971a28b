"""RolloutManager: the Ray actor that owns generation (router, engines, data source, rollout function).

Created by the driver as `ray.remote(num_cpus=0)(RolloutManager).remote(args, pg)`. It starts an
sglang-router (or uses `--sglang-router-ip/--sglang-router-port`), one engine actor per
`--rollout-num-gpus-per-engine` GPUs, registers every engine with the router, and turns each rollout's
samples into a `TrainBatch` plus `rollout/*` metrics.

Simplifications and choices:
- Engines are created in one go; `shutdown()` is the single place that reaps them and the router. With
  `--use-fault-tolerance` a health monitor (slime/ray/engine_health.py) takes a failing engine out
  (deregistered, server stopped) and `before_weight_update` restarts its server in the same actor and
  re-registers it, so the push that follows brings it to the current weights; the actor handles stay the same.
- Samples marked FAILED stay in the batch (so the batch size identity holds and groups stay whole) but
  get an all-zero loss mask: a failed generation or reward never produces a gradient. They are counted
  in `rollout/failed_count`.
- `--debug-train-only` skips the router and engines; with `--load-debug-rollout-data` the samples of
  each rollout are read from that file (a template with `{rollout_id}`) instead of being generated.
- `--rollout-external-engine-addrs` registers already running engines (no engine actors are created).
- An SGLang engine wider than a node (`--rollout-num-gpus-per-engine` > `--num-gpus-per-node`) gets one
  actor per node, each on the placement-group bundle of its node's first GPU; node rank 0's actor is the
  engine (URL, control calls), the others only run their server process and are reaped with it.
- Weight pushes: the driver brackets each push with `before_weight_update()` / `after_weight_update(v)`.
  This actor runs one method at a time, so `before_weight_update` only starts once every `generate`
  queued before it has returned: weights never change under the default rollout. A rollout function
  whose module defines `before_weight_update(args)`, `after_weight_update(args, version)` or
  `shutdown_rollout(args)` (the fully async rollout) is told about pushes and shutdown through them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import time
from typing import Any

import httpx
import ray

from slime.backends.sglang_utils.sglang_engine import engine_nnodes
from slime.ray.engine_health import EngineHealthMonitor
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.router import RouterClient, RouterProcess
from slime.utils.metrics import (
    compute_eval_metrics,
    compute_rollout_metrics,
    compute_weight_version_metrics,
    multi_turn_metrics,
    wait_time_ratio,
)
from slime.utils.misc import load_function
from slime.utils.net import node_ip
from slime.utils.ppo_utils import group_normalize_rewards
from slime.utils.types import Sample, TrainBatch

logger = logging.getLogger(__name__)

ENGINE_CLASSES = {
    "hf": "slime.backends.hf_engine.engine.HFEngine",
    "sglang": "slime.backends.sglang_utils.sglang_engine.SGLangEngine",
}
MEMORY_TAGS = ("weights", "kv_cache")  # what release_memory_occupation frees when no tags are given
GROUP_NORMALIZED_ESTIMATORS = {"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"}


class RolloutManager:
    def __init__(self, args: Any, pg: tuple[Any, list[int]] | None):
        self.args = args
        self.pg = pg
        self.engines: list[Any] = []  # one actor per engine (node rank 0 of a multi-node engine)
        self.engine_followers: list[Any] = []  # the actors of node ranks > 0 of multi-node engines
        self.engine_urls: list[str] = []
        self.router: RouterClient | None = None
        self._owns_router = False
        self._shut_down = False
        self.weight_version: int | None = None  # the last version pushed to the engines (after_weight_update)
        self._last_generate_end: float | None = None  # wall clock; idle time between generates = waiting
        self.monitor: EngineHealthMonitor | None = None  # --use-fault-tolerance
        self._released_tags: set[str] = set()  # engine memory released (release_memory), not yet resumed
        self._counts_reported = True  # False once an engine turned out not to report num_finished_requests
        self.engine_restarts = 0
        try:
            # The cheap, error-prone parts first, so a bad plugin path or dataset starts no process.
            self.generate_rollout = load_function(args.rollout_function_path, "--rollout-function-path")
            self.data_source = self._make_data_source()
            if not getattr(args, "debug_train_only", False):
                self._start_router()
                self._start_engines()
                for url in self.engine_urls:
                    self.router.add_worker(url)
            args.router_url = self.router.url if self.router else None
            args.engine_urls = list(self.engine_urls)
            args.rollout_num_engines = len(self.engine_urls)
            if getattr(args, "use_fault_tolerance", False) and self.engines:
                self.monitor = EngineHealthMonitor(
                    lambda: list(self.engine_urls), self._take_out, args.rollout_health_check_interval,
                    args.rollout_health_check_timeout, args.rollout_health_check_first_wait).start()
        except BaseException:
            self.shutdown()
            raise

    # ---- construction ---------------------------------------------------------------------------
    def _start_router(self) -> None:
        args = self.args
        if getattr(args, "sglang_router_ip", None):
            port = getattr(args, "sglang_router_port", None)
            if not port:
                raise ValueError(
                    f"--sglang-router-ip={args.sglang_router_ip} names an external router but "
                    "--sglang-router-port is not set; pass both"
                )
            self.router = RouterClient(f"http://{args.sglang_router_ip}:{port}")
            if not self.router.is_alive():
                raise ConnectionError(
                    f"external router {self.router.url} (--sglang-router-ip/--sglang-router-port) does not "
                    "answer GET /health; start it first or drop the flags to let slime start one"
                )
            return
        router_args = router_args_from(args)
        policy = router_args.pop("policy", None) or "round_robin"
        self.router = RouterProcess(
            host=node_ip(),
            port=getattr(args, "sglang_router_port", None),
            policy=policy,
            extra_args=router_args,
        )
        self._owns_router = True
        self.router.start()
        # Custom generate functions written for slime address the router through these two fields.
        args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port

    def _start_engines(self) -> None:
        args = self.args
        external = getattr(args, "rollout_external_engine_addrs", None)
        if external:
            self.engine_urls = [a if "://" in a else f"http://{a}" for a in external]
            return
        per_engine = args.rollout_num_gpus_per_engine
        num_engines = args.rollout_num_gpus // per_engine
        if num_engines < 1:
            raise ValueError(
                f"--rollout-num-gpus={args.rollout_num_gpus} is smaller than "
                f"--rollout-num-gpus-per-engine={per_engine}: no engine fits; raise the first or lower the second"
            )
        backend = getattr(args, "rollout_backend", "sglang") or "sglang"
        if backend not in ENGINE_CLASSES:
            raise ValueError(f"--rollout-backend={backend} is not one of {sorted(ENGINE_CLASSES)}")
        engine_cls = ray.remote(load_function(ENGINE_CLASSES[backend], "--rollout-backend"))
        nnodes = engine_nnodes(args) if backend == "sglang" else 1
        per_node = per_engine // nnodes
        for i in range(num_engines):
            leader = engine_cls.options(**self._engine_options(i * per_engine, per_engine)).remote(args, i)
            self.engines.append(leader)
            if nnodes > 1:  # one actor per node; node rank 0 picks the address the others rendezvous at
                addr = ray.get(leader.get_dist_init_addr.remote())
                for r in range(1, nnodes):
                    options = self._engine_options(i * per_engine + r * per_node, per_engine)
                    self.engine_followers.append(
                        engine_cls.options(**options).remote(args, i, node_rank=r, dist_init_addr=addr))
        # all nodes of an engine start together: each server waits for the others at the rendezvous
        started = ray.get([e.init.remote() for e in self.engines + self.engine_followers])
        self.engine_urls = started[: len(self.engines)]

    def _engine_options(self, first_gpu: int, per_engine: int) -> dict[str, Any]:
        # Not torch.cuda.is_available(): this actor holds no GPU, so Ray hides every GPU from it.
        use_cuda = getattr(self.args, "use_cuda", None)
        if use_cuda is None:
            use_cuda = ray.cluster_resources().get("GPU", 0) > 0
        if use_cuda:
            # Colocated engines share their GPU with a training actor, so they take a fraction of it;
            # within a placement group an actor lives in one bundle, the engine's other GPUs are
            # reserved by the bundles that follow it.
            num_gpus = 0.2 if getattr(self.args, "colocate", False) else (1 if self.pg else per_engine)
            options: dict[str, Any] = {"num_cpus": 0.2, "num_gpus": num_gpus}
        elif getattr(self.args, "colocate", False):
            # A CPU bundle holds {CPU: 1}, taken by the training rank that shares it; the engine takes no
            # CPU slot of its own, as a colocated engine takes no whole GPU above.
            options = {"num_cpus": 0, "num_gpus": 0}
        else:
            options = {"num_cpus": 1, "num_gpus": 0}
        if self.pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg, bundle_indices = self.pg
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=bundle_indices[first_gpu],
                placement_group_capture_child_tasks=True,
            )
        return options

    def _make_data_source(self) -> Any:
        path = getattr(self.args, "data_source_path", None)
        if path:
            return load_function(path, "--data-source-path")(self.args)
        return RolloutDataSourceWithBuffer(self.args)

    # ---- queries --------------------------------------------------------------------------------
    def get_engines(self) -> list[Any]:
        return list(self.engines)

    def get_router_url(self) -> str | None:
        return self.router.url if self.router else None

    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def dataset_size(self) -> int:
        size = self.data_source.dataset_size
        return int(size() if callable(size) else size)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, rollout_id: int, with_timing: bool = False):
        """One rollout: samples from the rollout function (or a debug dump) -> (TrainBatch, metrics).

        With `with_timing` (train_async.py) a third item `{"generate_start", "generate_end"}` (wall clock,
        `time.time()`) comes back, so the driver can log when generation ran next to when training ran.
        """
        args = self.args
        wall_start = time.time()
        start = time.perf_counter()
        served_before = self._engine_request_counts()
        if getattr(args, "load_debug_rollout_data", None):
            samples = load_debug_samples(args.load_debug_rollout_data, rollout_id)
        else:
            result = self.generate_rollout(args, rollout_id, self.data_source, evaluation=False)
            if inspect.isawaitable(result):
                result = asyncio.run(result)
            samples = flatten_groups(result, args.rollout_function_path)
        rollout_time = time.perf_counter() - start

        expected = args.rollout_batch_size * args.n_samples_per_prompt
        if len(samples) != expected:
            raise RuntimeError(
                f"rollout {rollout_id}: {args.rollout_function_path} returned {len(samples)} samples, expected "
                f"--rollout-batch-size ({args.rollout_batch_size}) x --n-samples-per-prompt "
                f"({args.n_samples_per_prompt}) = {expected}; the rollout function must return "
                "rollout_batch_size groups of n_samples_per_prompt samples"
            )
        if getattr(args, "save_debug_rollout_data", None):
            save_debug_samples(args.save_debug_rollout_data, rollout_id, samples)

        batch = build_train_batch(args, samples)
        failed = sum(s.status == Sample.Status.FAILED for s in samples)
        metrics = compute_rollout_metrics(
            batch.raw_rewards, batch.rewards, batch.response_lengths, batch.truncated, batch.group_indices,
            failed_count=failed, rollout_time=rollout_time,
        )  # fmt: skip
        metrics.update(compute_weight_version_metrics([s.weight_versions for s in samples]))
        if getattr(args, "log_multi_turn", False):
            metrics.update(multi_turn_metrics([s.metadata for s in samples]))
        metrics.update(engine_load_metrics(served_before, self._engine_request_counts()))
        if self.monitor is not None:
            metrics["rollout/engine_restarts"] = float(self.engine_restarts)
        if self._last_generate_end is not None:
            # Generation side idle between the previous generate and this one (waiting on the trainer).
            idle = max(0.0, wall_start - self._last_generate_end)
            metrics["perf/rollout_wait_time_ratio"] = wait_time_ratio(idle, idle + rollout_time)
        metrics.update(_module_metrics(self.generate_rollout))  # a background rollout reports its own ratio
        self._last_generate_end = time.time()
        if with_timing:
            return batch, metrics, {"generate_start": wall_start, "generate_end": self._last_generate_end}
        return batch, metrics

    def _engine_request_counts(self) -> list[int] | None:
        """Finished requests per engine so far (`num_finished_requests` of GET /get_server_info), or None
        when an engine does not report it (SGLang servers do not) or does not answer within a second."""
        counts = []
        for url in self.engine_urls if self._counts_reported else []:
            try:
                info = httpx.get(url + "/get_server_info", timeout=1.0, trust_env=False).json()
                counts.append(int(info["num_finished_requests"]))
            except (httpx.HTTPError, ValueError, TypeError):
                return None
            except KeyError:  # this engine kind never reports it: stop asking
                self._counts_reported = False
                return None
        return counts or None

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Run the eval function (`--eval-function-path`, else the rollout function with `evaluation=True`),
        which returns `{name: {"rewards": [...], "truncated": [...], "samples": [...]}}`, and turn each set
        into `eval/<name>` metrics."""
        args = self.args
        path = getattr(args, "eval_function_path", None) or args.rollout_function_path
        fn = load_function(path, "--eval-function-path")
        result = fn(args, rollout_id, self.data_source, evaluation=True)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
        if not isinstance(result, dict):
            raise TypeError(
                f"eval function {path} returned {type(result).__name__}, expected {{name: {{rewards, ...}}}}"
            )
        metrics: dict[str, float] = {}
        for name, data in result.items():
            samples = data.get("samples")
            groups = [s.group_index for s in samples] if samples else None
            metrics.update(
                compute_eval_metrics(
                    name, data["rewards"], data.get("truncated", []), groups, getattr(args, "log_passrate", False)
                )
            )
        return metrics

    # ---- engine control (fan out to every engine) -----------------------------------------------
    def _fan_out(self, method: str, *a, **kw) -> list[Any]:
        return ray.get([getattr(e, method).remote(*a, **kw) for e in self.engines])

    def pause_engines(self) -> None:
        self._fan_out("pause_generation")

    def continue_engines(self) -> None:
        self._fan_out("continue_generation")

    def flush_cache(self) -> None:
        self._fan_out("flush_cache")

    def release_memory(self, tags: list[str] | None = None) -> None:
        if self.monitor is not None and not self._released_tags:  # a released engine is not a dead one
            self.monitor.pause()
        self._released_tags |= set(tags or MEMORY_TAGS)
        self._fan_out("release_memory_occupation", tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._fan_out("resume_memory_occupation", tags)
        was_released = bool(self._released_tags)
        self._released_tags -= set(tags or MEMORY_TAGS)
        if self.monitor is not None and was_released and not self._released_tags:
            self.monitor.resume()

    # ---- weight pushes (the driver pushes; these bracket it) ---------------------------------------
    def before_weight_update(self) -> None:
        """Called right before a push; returns once no generation of ours is in flight. Engines the health
        monitor took out are restarted here, so the push that follows brings them to the current weights."""
        hook = _module_hook(self.generate_rollout, "before_weight_update")
        if hook is not None:
            hook(self.args)
        if self.monitor is not None:
            self.monitor.pause()
            self.monitor.check_once(while_paused=True)  # one that died since the last periodic check
            self._restart_dead_engines()

    def after_weight_update(self, weight_version: int) -> None:
        """Called after a push: record the engines' new version and let a background rollout resume."""
        self.weight_version = int(weight_version)
        if self.monitor is not None:
            self.monitor.resume()
        hook = _module_hook(self.generate_rollout, "after_weight_update")
        if hook is not None:
            hook(self.args, self.weight_version)

    # ---- fault tolerance (--use-fault-tolerance) ------------------------------------------------------
    def _take_out(self, i: int) -> None:
        """Called by the health monitor's thread: no new requests to engine i, and its server is stopped
        (requests it had in flight fail and are retried through the router on the other engines)."""
        url = self.engine_urls[i]
        _best_effort(f"deregister {url}", lambda: self.router.remove_worker(url))
        self.engines[i].shutdown.remote()

    def _restart_dead_engines(self) -> None:
        for i in self.monitor.dead():
            self.engine_urls[i] = ray.get(self.engines[i].init.remote())  # the actor starts a fresh server
            self.args.engine_urls = list(self.engine_urls)
            self.router.add_worker(self.engine_urls[i])
            self.monitor.revive(i)
            self.engine_restarts += 1
            logger.warning("engine %d restarted at %s; the weight push that follows brings it to the current "
                           "version", i, self.engine_urls[i])

    def get_weight_version(self) -> int | None:
        return self.weight_version

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int) -> None:
        self.data_source.load(rollout_id)

    # ---- teardown -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Deregister engines, shut them down, kill their actors, stop our router. Idempotent; every
        step runs even if an earlier one fails, so nothing is left running."""
        if self._shut_down:
            return
        self._shut_down = True
        if getattr(self, "monitor", None) is not None:
            _best_effort("stop health monitor", self.monitor.stop)
        hook = _module_hook(getattr(self, "generate_rollout", None), "shutdown_rollout")
        if hook is not None:  # stop a background rollout before its engines go away
            _best_effort("stop background rollout", lambda: hook(self.args))
        if self.router is not None:
            for url in self.engine_urls:
                _best_effort(f"deregister {url}", lambda u=url: self.router.remove_worker(u))
        actors = self.engines + self.engine_followers
        if actors:
            refs = [e.shutdown.remote() for e in actors]
            _best_effort("engine shutdown", lambda: ray.get(refs, timeout=timeout))
            for e in actors:
                _best_effort("kill engine actor", lambda a=e: ray.kill(a, no_restart=True))
        if self._owns_router:
            _best_effort("stop router", self.router.stop)
        self.engines, self.engine_followers = [], []


def engine_load_metrics(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """Requests each engine finished during one rollout (`rollout/engine_requests/<i>`) and how uneven
    that was (`rollout/engine_load_imbalance`: busiest engine / mean; 1.0 is perfectly even)."""
    if before is None or after is None or len(before) != len(after):
        return {}
    served = [b - a for a, b in zip(before, after)]
    out = {f"rollout/engine_requests/{i}": float(n) for i, n in enumerate(served)}
    mean = sum(served) / len(served)
    if mean > 0:
        out["rollout/engine_load_imbalance"] = max(served) / mean
    return out


def router_args_from(args: Any) -> dict[str, Any]:
    """sglang-router flags from `args`: the forwarded `--router-<field>` flags (`args.router_args`), plus
    `--router-policy` and `--sglang-router-request-timeout-secs`, which are slime's own flags."""
    out = dict(getattr(args, "router_args", None) or {})
    if getattr(args, "router_policy", None):
        out["policy"] = args.router_policy
    timeout = getattr(args, "sglang_router_request_timeout_secs", None)
    if timeout is not None:
        out.setdefault("request_timeout_secs", timeout)
    return out


def flatten_groups(groups: Any, source: str) -> list[Sample]:
    """Groups of samples in order -> one flat list (a bare Sample counts as a group of one)."""
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"--rollout-function-path={source} returned {type(groups).__name__}, expected list[list[Sample]]"
        )
    flat: list[Sample] = []
    for g in groups:
        for s in [g] if isinstance(g, Sample) else g:
            if not isinstance(s, Sample):
                raise TypeError(
                    f"--rollout-function-path={source} returned a {type(s).__name__} where a Sample was expected"
                )
            flat.append(s)
    return flat


def build_train_batch(args: Any, samples: list[Sample]) -> TrainBatch:
    """Samples (in order) -> TrainBatch, with group-normalised rewards for GRPO-like estimators."""
    raw = [s.get_reward_value(getattr(args, "reward_key", None)) for s in samples]
    n = args.n_samples_per_prompt
    group_indices = [s.group_index if s.group_index is not None else i // n for i, s in enumerate(samples)]
    rewards = _normalized_rewards(args, samples, raw, group_indices)

    loss_masks = []
    for s in samples:
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(
                f"sample {s.index} (group {s.group_index}): loss_mask has {len(mask)} entries but "
                f"response_length={s.response_length}; a custom generate function must keep them equal"
            )
        loss_masks.append([0] * len(mask) if s.status == Sample.Status.FAILED else mask)

    log_probs = None
    if samples and all(s.rollout_log_probs is not None for s in samples):
        log_probs = [list(s.rollout_log_probs) for s in samples]
        for s, lp in zip(samples, log_probs):
            if len(lp) != s.response_length:
                raise ValueError(
                    f"sample {s.index} (group {s.group_index}): {len(lp)} rollout log-probs for "
                    f"response_length={s.response_length}"
                )
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=loss_masks,
        rewards=rewards,
        raw_rewards=raw,
        truncated=[s.status == Sample.Status.TRUNCATED for s in samples],
        group_indices=group_indices,
        rollout_log_probs=log_probs,
    )


def _normalized_rewards(args: Any, samples: list[Sample], raw: list[float], group_indices: list[int]) -> list[float]:
    custom = getattr(args, "custom_reward_post_process_path", None)
    if custom:
        _, rewards = load_function(custom, "--custom-reward-post-process-path")(args, samples)
        return [float(r) for r in rewards]
    if args.advantage_estimator not in GROUP_NORMALIZED_ESTIMATORS:
        return list(raw)
    if getattr(args, "disable_rewards_normalization", False):
        return list(raw)
    # REINFORCE++-baseline only subtracts the group mean; GRPO-like estimators also divide by the std.
    std_normalize = (not getattr(args, "disable_grpo_std_normalization", False)
                     and args.advantage_estimator != "reinforce_plus_plus_baseline")
    return [float(r) for r in group_normalize_rewards(raw, group_indices, std_normalize)]


def save_debug_samples(template: str, rollout_id: int, samples: list[Sample]) -> str:
    import torch

    path = template.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
    logger.info("rollout %d: %d samples saved to %s", rollout_id, len(samples), path)
    return path


def load_debug_samples(template: str, rollout_id: int) -> list[Sample]:
    import torch

    path = template.format(rollout_id=rollout_id)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--load-debug-rollout-data={template}: {path} does not exist for rollout {rollout_id}"
        )
    data = torch.load(path, weights_only=False)
    return [Sample.from_dict(d) for d in data["samples"]]


def _module_metrics(fn: Any) -> dict[str, float]:
    """Counters the rollout function's module exposes through `last_rollout_metrics()` (the default
    rollout reports dynamic-filter drops, aborted groups and failures there)."""
    hook = getattr(sys.modules.get(getattr(fn, "__module__", None) or ""), "last_rollout_metrics", None)
    return {k: float(v) for k, v in hook().items()} if callable(hook) else {}


def _module_hook(fn: Any, name: str):
    """`name` from the rollout function's module when it defines one (see the module docstring)."""
    hook = getattr(sys.modules.get(getattr(fn, "__module__", None) or ""), name, None)
    return hook if callable(hook) else None


def _best_effort(what: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - teardown keeps going so every process is reaped
        logger.warning("RolloutManager shutdown: %s failed: %s: %s", what, type(e).__name__, e)
