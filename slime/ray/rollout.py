"""RolloutManager: the Ray actor that owns generation (router, engines, data source, rollout function).

Created by the driver as `ray.remote(num_cpus=0)(RolloutManager).remote(args, pg)`. It starts an
sglang-router (or uses `--sglang-router-ip/--sglang-router-port`), one engine actor per
`--rollout-num-gpus-per-engine` GPUs, registers every engine with the router, and turns each rollout's
samples into a `TrainBatch` (slime/rollout/train_data.py) plus `rollout/*` metrics.

Simplifications and choices:
- Engines are created in one go; `shutdown()` is the single place that reaps them and the router. With
  `--use-fault-tolerance` a health monitor (slime/ray/engine_health.py) takes a failing engine out
  (deregistered, server stopped) and `before_weight_update` restarts its server in the same actor and
  re-registers it, so the push that follows brings it to the current weights; the actor handles stay the same.
  When the engine lost mid-rollout was the last one serving (one engine, as on a single GPU) and the driver
  named the trainer ranks (`set_weight_source`, train.py), it is restarted at once and given the current
  weights by the trainer (idle while train.py generates) before the router sends it anything; the rollout's
  retried requests then complete on it.
- Samples marked FAILED are counted in `rollout/failed_count` (train_data.py gives them an all-zero loss mask).
  When a rollout or an eval fails (or, without --use-fault-tolerance, a rollout finishes with FAILED samples and a
  dead engine), the engines are asked whether their server ended or logged an error since it began
  (`ServerEngine.status`); the error raised then starts with the first such engine's one-line report (which
  engine, its exit code or signal, its log's telling line, the fix), before the rollout's own error (the router's
  503, say). `--use-fault-tolerance` logs the same line when it takes an engine out.
- slime's hooks around a rollout are called here as slime calls them: `set_current_rollout_id` before the
  rollout / eval function (what `--rollout-sample-hook-path` hooks are told), the samples -> train data
  conversion (`--custom-convert-samples-to-train-data-path`, slime/rollout/train_data.py), and
  `--custom-rollout-log-function-path` / `--custom-eval-rollout-log-function-path` (True: this rollout's
  default metrics are not returned). A rollout may hold more samples than rollouts: samples split from one
  rollout by a custom generate function share its `rollout_id` and count once against the batch size.
- `--debug-train-only` skips the router and engines; with `--load-debug-rollout-data` the samples of
  each rollout are read from that file (a template with `{rollout_id}`) instead of being generated; with
  `--load-debug-rollout-data-subsample` only a part of them (train_data.replayed_samples).
- `--rollout-external-engine-addrs` registers already running engines (no engine actors are created).
- `--engine-api-key`: the router it starts requires the key and every engine is registered with it; this process's
  `slime.utils.http_utils` `post` / `get` send it to the router, the engines (also external ones, and engines
  restarted on a new port) and the OPD teacher (`--rm-url` under `--use-opd --opd-type sglang`), so rollout
  functions calling them through those helpers need no change. Health probes and request counts carry it too.
- An SGLang engine wider than a node (`--rollout-num-gpus-per-engine` > `--num-gpus-per-node`) gets one
  actor per node, each on the placement-group bundle of its node's first GPU; node rank 0's actor is the
  engine (URL, control calls), the others only run their server process and are reaped with it.
- Weight pushes: the driver brackets each push with `before_weight_update()` / `after_weight_update(v)`.
  This actor runs one method at a time, so `before_weight_update` only starts once every `generate`
  queued before it has returned: weights never change under the default rollout. A rollout function that
  declares `@rollout_lifecycle(...)` (slime/rollout/base_types.py; the fully async rollout) is told about
  pushes and shutdown through the calls it declared.
- Memory (colocated: `release_memory` / `resume_memory`) is released only from an idle engine, as SGLang's
  scheduler requires (it asserts and its server dies): pushes and released memory are quiet spells in which a
  background rollout is paused and the health monitor rests with no probe left in flight, and each engine is
  waited for until it serves no request before it releases. A background rollout resumes after the push and
  once every engine has its memory back.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import httpx
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.observability.rollout_metrics import top_p_kept_vocab_metrics
from slime.ray.engine_health import EngineHealthMonitor
from slime.rollout.base_types import call_rollout_fn, lifecycle_of
from slime.rollout.generation import complete_generate_body, set_engine_adapter
from slime.rollout.router import RouterClient, RouterProcess, url_of
from slime.rollout.sample_hooks import set_current_rollout_id
from slime.rollout.train_data import (
    flatten_groups,
    replayed_samples,
    rollout_count,
    samples_to_train_batch,
    save_debug_eval_samples,
    save_debug_samples,
)
from slime.utils.eval_config import eval_datasets
from slime.utils.hooks import hooks_of, sample_hook
from slime.utils.http_utils import (
    bearer_headers,
    probe_get,
    set_engine_api_key,
    set_generate_rewrite,
    trust_engine_url,
)
from slime.utils.lora_adapter import request_adapter
from slime.utils.metrics import (
    compute_eval_metrics,
    compute_rollout_metrics,
    compute_weight_version_metrics,
    multi_turn_metrics,
    wait_time_ratio,
)
from slime.utils.misc import load_function
from slime.utils.net import node_ip
from slime.utils.placement import engine_node_count
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

ENGINE_CLASSES = {
    "hf": "slime.backends.hf_engine.engine.HFEngine",
    "sglang": "slime.backends.sglang_utils.sglang_engine.SGLangEngine",
}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # what SGLang's release_memory_occupation frees with no tags
ENGINE_QUERY_TIMEOUT_S = 30.0  # an engine actor's answer to log_size() / status() (error reports only)
# how long a take-out waits for an engine's server that failed its health check to exit, before calling it running
# (a killed server's exit can lag its closed port on a busy machine)
TAKE_OUT_SETTLE_S = 2.0
# the per-rollout request counts (a metric only): a busy engine on a loaded CPU machine may take over a second to
# answer /server_info, and the rollout's metrics would then go without them
COUNTS_TIMEOUT_S = 5.0


class RolloutManager:
    def __init__(self, args: Any, pg: tuple[Any, list[int]] | None):
        self.args = args  # this actor's copy; for a router it starts, the router's address is filled in
        self.pg = pg
        self.generate_rollout = None
        self.hooks = None  # this process's plugin hooks (slime.utils.hooks), resolved first thing below
        self.engines: list[Any] = []  # one actor per engine (node rank 0 of a multi-node engine)
        self.engine_followers: list[Any] = []  # the actors of node ranks > 0 of multi-node engines
        self.engine_urls: list[str] = []
        self.router: RouterClient | None = None
        self._owns_router = False
        self._shut_down = False
        self.weight_version: int | None = None  # the last version pushed to the engines (after_weight_update)
        self._last_generate_end: float | None = None  # wall clock; idle time between generates = waiting
        self.monitor: EngineHealthMonitor | None = None  # --use-fault-tolerance
        self._released: dict[int, set[str]] = {}  # engine index -> memory tags released and not yet resumed
        self._quiet_for: set[str] = set()  # why generation is stopped now: "push", "memory" (`_quiet`)
        self._counts_reported = True  # False once an engine turned out not to report num_finished_requests
        self.engine_restarts = 0
        self._restart_lock = threading.Lock()  # the monitor's thread and before_weight_update both restart engines
        self._weight_source: list[Any] = []  # trainer ranks that can push the current weights (set_weight_source)
        self._generating = False
        try:
            # The cheap, error-prone parts first, so a bad plugin path or dataset starts no process.
            self.hooks = hooks_of(args)
            _load_eval_dataset_hooks(args)
            self.generate_rollout = self.hooks.rollout_function
            self.data_source = self._make_data_source()
            set_engine_api_key(args.engine_api_key)
            set_generate_rewrite(functools.partial(complete_generate_body, args))  # plugins' own requests
            if args.use_opd and args.opd_type == "sglang" and args.rm_url:
                # the teacher server: an SGLang-API engine started for this job, serving another model
                trust_engine_url(args.rm_url, serves_policy=False)
            if not args.debug_train_only:
                self._start_router()
                self._start_engines()
                for url in self.engine_urls:
                    self._add_worker(url)
            if args.use_fault_tolerance and self.engines:
                self.monitor = EngineHealthMonitor(
                    lambda: list(self.engine_urls), self._take_out, args.rollout_health_check_interval,
                    args.rollout_health_check_timeout, args.rollout_health_check_first_wait,
                    headers=bearer_headers(args.engine_api_key)).start()
        except BaseException:
            self.shutdown()
            raise

    # ---- construction ---------------------------------------------------------------------------
    def _start_router(self) -> None:
        args = self.args
        if args.sglang_router_ip:
            self.router = RouterClient(url_of(args.sglang_router_ip, args.sglang_router_port),
                                       api_key=args.engine_api_key)
            trust_engine_url(self.router.url)
            if not self.router.is_alive():
                raise ConnectionError(
                    f"external router {self.router.url} (--sglang-router-ip/--sglang-router-port) does not "
                    "answer GET /health; start it first or drop the flags to let slime start one"
                )
            return
        router_args = router_args_from(args)
        policy = router_args.pop("policy")
        self.router = RouterProcess(host=node_ip(), port=args.sglang_router_port, policy=policy,
                                    extra_args=router_args, api_key=args.engine_api_key)
        self._owns_router = True
        self.router.start()
        trust_engine_url(self.router.url)  # after start: a taken port moves it
        # The rollout functions (slime's custom generate functions too) address the router through these two
        # fields: this actor's args get the address of the router it started, once, before any of them runs.
        args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port

    def _start_engines(self) -> None:
        args = self.args
        external = args.rollout_external_engine_addrs
        if external:
            self.engine_urls = [a if "://" in a else f"http://{a}" for a in external]
            return
        per_engine = args.rollout_num_gpus_per_engine
        num_engines = args.rollout_num_gpus // per_engine
        backend = args.rollout_backend
        engine_cls = ray.remote(load_function(ENGINE_CLASSES[backend], "--rollout-backend"))
        nnodes = engine_node_count(args)
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

    def _add_worker(self, url: str) -> None:
        """Register an engine with the router; `post` / `get` of this process send it the engine key from now on."""
        trust_engine_url(url)
        self.router.add_worker(url)

    def _engine_options(self, first_gpu: int, per_engine: int) -> dict[str, Any]:
        # args.use_cuda, not torch.cuda.is_available(): this actor holds no GPU, so Ray hides every GPU from it.
        if self.args.use_cuda:
            # Colocated engines share their GPU with a training actor, so they take a fraction of it;
            # within a placement group an actor lives in one bundle, the engine's other GPUs are
            # reserved by the bundles that follow it.
            num_gpus = 0.2 if self.args.colocate else (1 if self.pg else per_engine)
            options: dict[str, Any] = {"num_cpus": 0.2, "num_gpus": num_gpus}
        elif self.args.colocate:
            # A CPU bundle holds {CPU: 1}, taken by the training rank that shares it; the engine takes no
            # CPU slot of its own, as a colocated engine takes no whole GPU above.
            options = {"num_cpus": 0, "num_gpus": 0}
        else:
            options = {"num_cpus": 1, "num_gpus": 0}
        if self.pg is not None:
            pg, bundle_indices = self.pg
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=bundle_indices[first_gpu],
                placement_group_capture_child_tasks=True,
            )
        return options

    def _make_data_source(self) -> Any:
        return self.hooks.data_source(self.args)

    # ---- queries --------------------------------------------------------------------------------
    def get_engines(self) -> list[Any]:
        return list(self.engines)

    def get_router_url(self) -> str | None:
        return self.router.url if self.router else None

    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def dataset_size(self) -> int:
        """Prompts the data source holds (`len()`, slime's DataSource contract)."""
        return len(self.data_source)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, rollout_id: int, with_timing: bool = False):
        """One rollout: samples from the rollout function (or a debug dump) -> (TrainBatch, metrics).

        With `with_timing` (train_async.py) a third item `{"generate_start", "generate_end"}` (wall clock,
        `time.time()`) comes back, so the driver can log when generation ran next to when training ran.
        """
        args = self.args
        wall_start = time.time()
        start = time.perf_counter()
        set_current_rollout_id(rollout_id)
        served_before = self._engine_request_counts()
        output_metrics: dict[str, Any] | None = None
        if args.load_debug_rollout_data:
            samples = replayed_samples(args, rollout_id)
        else:
            log_marks = self._engine_log_marks()
            self._generating = True
            try:
                output = call_rollout_fn(self.generate_rollout, args, rollout_id, self.data_source, evaluation=False)
            except Exception as e:
                self._raise_engine_failure(f"rollout {rollout_id} failed", log_marks, e)
                raise
            finally:
                self._generating = False
            samples = flatten_groups(output.samples, args.rollout_function_path)
            output_metrics = output.metrics
            if any(s.status == Sample.Status.FAILED for s in samples):
                self._raise_engine_failure(f"rollout {rollout_id}", log_marks, None)
        fn_metrics = output_metrics or {}
        rollout_time = time.perf_counter() - start

        expected = args.rollout_batch_size * args.n_samples_per_prompt
        rollouts = rollout_count(samples)
        if rollouts != expected and args.load_debug_rollout_data_subsample is None:
            split = f" in {len(samples)} samples" if len(samples) != rollouts else ""
            raise RuntimeError(
                f"rollout {rollout_id}: {args.rollout_function_path} returned {rollouts} rollouts{split}, expected "
                f"--rollout-batch-size ({args.rollout_batch_size}) x --n-samples-per-prompt "
                f"({args.n_samples_per_prompt}) = {expected}; the rollout function must return "
                "rollout_batch_size groups of n_samples_per_prompt samples (samples split from one rollout share "
                "its rollout_id)"
            )
        if args.save_debug_rollout_data:
            save_debug_samples(args.save_debug_rollout_data, rollout_id, samples)

        batch = samples_to_train_batch(args, samples)
        failed = sum(s.status == Sample.Status.FAILED for s in samples)
        metrics = compute_rollout_metrics(
            batch.raw_rewards, batch.rewards, batch.response_lengths, batch.truncated, batch.group_indices,
            failed_count=failed, rollout_time=rollout_time,
        )  # fmt: skip
        metrics.update(compute_weight_version_metrics([s.weight_versions for s in samples]))
        # samples whose generate recorded top-p spans (Sample.append_response_tokens): vocab kept per token
        metrics.update({f"rollout/{k}": v for k, v in top_p_kept_vocab_metrics(samples).items()})
        if args.log_multi_turn:
            metrics.update(multi_turn_metrics([s.metadata for s in samples]))
        metrics.update(engine_load_metrics(served_before, self._engine_request_counts()))
        if self.monitor is not None:
            metrics["rollout/engine_restarts"] = float(self.engine_restarts)
        if self._last_generate_end is not None:
            # Generation side idle between the previous generate and this one (waiting on the trainer).
            idle = max(0.0, wall_start - self._last_generate_end)
            metrics["perf/rollout_wait_time_ratio"] = wait_time_ratio(idle, idle + rollout_time)
        metrics.update({k: float(v) for k, v in fn_metrics.items()})  # a background rollout reports its own ratio
        self._last_generate_end = time.time()
        if _custom_log(self.hooks.custom_rollout_log_function, rollout_id, args, samples, output_metrics,
                       rollout_time):
            metrics = {}  # the plugin logged this rollout itself
        if with_timing:
            return batch, metrics, {"generate_start": wall_start, "generate_end": self._last_generate_end}
        return batch, metrics

    def _engine_request_counts(self) -> list[int] | None:
        """Finished requests per engine so far (`num_finished_requests` of GET /server_info), or None
        when an engine does not report it (SGLang servers do not) or does not answer within `COUNTS_TIMEOUT_S`."""
        counts = []
        for url in self.engine_urls if self._counts_reported else []:
            try:
                info = probe_get(url + "/server_info", timeout=COUNTS_TIMEOUT_S,
                                 headers=bearer_headers(self.args.engine_api_key)).json()
                counts.append(int(info["num_finished_requests"]))
            except (httpx.HTTPError, ValueError, TypeError):
                return None
            except KeyError:  # this engine kind never reports it: stop asking
                self._counts_reported = False
                return None
        return counts or None

    # ---- why engines failed --------------------------------------------------------------------------------
    def _engine_log_marks(self) -> list[int | None]:
        """Each engine's log size now: after a failure, only what an engine logged since is looked at."""
        if not self.engines:
            return []
        try:
            return ray.get([e.log_size.remote() for e in self.engines], timeout=ENGINE_QUERY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a question for error reports must not fail the rollout
            logger.warning("could not read the engines' log sizes (%s: %s); failures will be reported from the "
                           "dead engines only", type(e).__name__, e)
            return [None] * len(self.engines)

    def _engine_failures(self, log_marks: list[int | None]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """([(index, report)] of engines whose server ended or whose Ray actor is gone, the same of running engines
        that logged a telling error since `log_marks`), each report one line (ServerEngine.failure_report)."""
        dead, failing = [], []
        for i, engine in enumerate(self.engines):
            since = log_marks[i] if i < len(log_marks) else None
            try:
                status = ray.get(engine.status.remote(since), timeout=ENGINE_QUERY_TIMEOUT_S)
            except ray.exceptions.RayActorError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                url = self.engine_urls[i] if i < len(self.engine_urls) else "?"
                dead.append((i, f"engine {i} ({url}): its Ray actor is gone, its server with it: {first}"))
                continue
            except Exception as e:  # noqa: BLE001 - an engine that does not answer tells nothing
                logger.warning("engine %d did not answer status(): %s: %s", i, type(e).__name__, e)
                continue
            if status["report"]:
                (failing if status["alive"] else dead).append((i, status["report"]))
        return dead, failing

    def _raise_engine_failure(self, what: str, log_marks: list[int | None], error: Exception | None) -> None:
        """After a rollout that raised `error` (or, with `error` None, one that finished with FAILED samples): raise
        an error whose first line is the first engine's own report when an engine died or logged an error meanwhile
        (the rollout's error, e.g. the router's 503, and the engine's log tail follow), else return. A finished
        rollout raises only for a dead engine and without --use-fault-tolerance (nothing would bring it back); a
        running engine's error is then logged."""
        if not self.engines:
            return
        dead, failing = self._engine_failures(log_marks)
        if error is None:
            if dead and not self.args.use_fault_tolerance:
                failing = []
            else:
                for _, report in dead + failing:
                    logger.warning("%s: %s", what, report)
                return
        found = dead + failing
        if not found:
            return
        message = f"{what}: {found[0][1]}"
        logger.error(message)
        lines = [message] + [f"also: {report}" for _, report in found[1:]]
        if error is not None:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            lines.append(f"the rollout's own error: {type(error).__name__}: {first}")
        else:
            lines.append("(without --use-fault-tolerance a dead engine is not restarted: the run cannot go on)")
        try:
            lines.append(f"last lines of engine {found[0][0]}'s log:\n"
                         + ray.get(self.engines[found[0][0]].log_tail.remote(), timeout=ENGINE_QUERY_TIMEOUT_S))
        except Exception:  # noqa: BLE001, S110 - the tail is a courtesy; the report above names the log file
            pass
        raise RuntimeError("\n".join(lines)) from error

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Run the eval function (`--eval-function-path`, else the rollout function with `evaluation=True`),
        which returns `{name: {"rewards": [...], "truncated": [...], "samples": [...]}}`, and turn each set
        into `eval/<name>` metrics."""
        args = self.args
        path = args.eval_function_path
        fn = self.hooks.eval_function
        set_current_rollout_id(rollout_id)
        log_marks = self._engine_log_marks()
        try:
            output = call_rollout_fn(fn, args, rollout_id, self.data_source, evaluation=True)
        except Exception as e:
            self._raise_engine_failure(f"eval at rollout {rollout_id} failed", log_marks, e)
            raise
        if not isinstance(output.data, dict):
            raise TypeError(f"eval function {path} returned {type(output.data).__name__}, expected "
                            "RolloutFnEvalOutput or {name: {rewards, ...}}")
        if args.save_debug_rollout_data:
            save_debug_eval_samples(args.save_debug_rollout_data, rollout_id, output.data)
        if _custom_log(self.hooks.custom_eval_rollout_log_function, rollout_id, args, output.data, output.metrics):
            return {}  # the plugin logged this eval itself
        metrics: dict[str, float] = {k: float(v) for k, v in (output.metrics or {}).items()}
        for name, data in output.data.items():
            samples = data.get("samples")
            groups = [s.group_index for s in samples] if samples else None
            metrics.update(
                compute_eval_metrics(
                    name, data["rewards"], data.get("truncated", []), groups, args.log_passrate
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
        """Every engine releases `tags` (all three when None: weights, KV cache, CUDA graphs) that it still holds,
        and only once it serves no request: SGLang's scheduler asserts it is idle and its server dies otherwise.
        So generation stops first (`_quiet`: a background rollout pauses, the health monitor rests and its probe in
        flight is answered), then each engine is waited for until its load reads zero (`wait_idle`; it fails
        naming the requests left and the server's log). An engine the monitor finds dead is skipped: it holds
        nothing, and is restarted before the next push."""
        wanted = set(tags or MEMORY_TAGS)
        self._quiet("memory")
        dead = self._dead_now()
        todo = {i: sorted(wanted - self._released.get(i, set())) for i in range(len(self.engines)) if i not in dead}
        todo = {i: t for i, t in todo.items() if t}
        ray.get([self.engines[i].wait_idle.remote() for i in todo])
        for i, t in todo.items():
            self._released.setdefault(i, set()).update(t)
        ray.get([self.engines[i].release_memory_occupation.remote(t) for i, t in todo.items()])

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every engine takes back those of `tags` it released (SGLang's scheduler fails on resuming a tag it holds,
        so an engine restarted meanwhile, which holds everything, is left alone; a dead one waits for its restart).
        Generation may go on once no engine has memory released (and no push runs)."""
        wanted = set(tags or MEMORY_TAGS)
        dead = self._dead_now()
        refs = []
        for i, engine in enumerate(self.engines):
            todo = sorted(wanted & self._released.get(i, set()))
            if todo and i not in dead:
                refs.append(engine.resume_memory_occupation.remote(todo))
                self._released[i] -= set(todo)
        ray.get(refs)
        self._end_quiet_if_all_resumed()

    def _end_quiet_if_all_resumed(self) -> None:
        if not any(self._released.values()):
            self._end_quiet("memory")

    def _dead_now(self) -> set[int]:
        """With fault tolerance, the engines dead now: one that died since the monitor's last round is found by a
        liveness probe (GET /health: no generation, the monitor is paused) and taken out."""
        if self.monitor is None:
            return set()
        self.monitor.check_once(while_paused=True, generate=False)
        return set(self.monitor.dead())

    # ---- quiet spells: no generation of ours while a push runs or engine memory is released ---------------
    def _quiet(self, reason: str) -> None:
        """Stop generation for `reason` ("push", "memory"): a background rollout (one declaring
        `before_weight_update`, slime/rollout/base_types.py) pauses, which returns once none of its requests is in
        flight, and the health monitor rests (`pause` returns once its probe in flight is answered). Reasons
        nest: generation comes back when the last one ends (`_end_quiet`)."""
        if not self._quiet_for:
            hook = lifecycle_of(self.generate_rollout).before_weight_update
            if hook is not None:
                hook(self.args)
            if self.monitor is not None:
                self.monitor.pause()
        self._quiet_for.add(reason)

    def _end_quiet(self, reason: str) -> None:
        """`reason` is over; when it was the last, the monitor probes again and a background rollout resumes with
        the version last pushed (its `after_weight_update`: after the push and once every engine has its
        memory back, never in between)."""
        if reason not in self._quiet_for:
            return
        self._quiet_for.discard(reason)
        if self._quiet_for:
            return
        if self.monitor is not None:
            self.monitor.resume()
        hook = lifecycle_of(self.generate_rollout).after_weight_update
        if hook is not None and self.weight_version is not None:
            hook(self.args, self.weight_version)

    # slime's names (RolloutManager.offload / onload / onload_weights / onload_kv), as its train.py calls them
    def offload(self) -> None:
        """Release the engines' weights, KV cache and CUDA graphs (the trainer takes the GPUs)."""
        self.release_memory(list(MEMORY_TAGS))

    def onload(self, tags: list[str] | None = None) -> None:
        self.resume_memory(tags)

    def onload_weights(self) -> None:
        """Before a push: the engines' weight memory back (SGLang's comes back uninitialised; the push fills it)."""
        self.resume_memory(["weights"])

    def onload_kv(self) -> None:
        """After a push: KV cache and CUDA graphs back, ready to generate."""
        self.resume_memory(["kv_cache", "cuda_graph"])

    def check_weights(self, action: str) -> list[Any]:
        """slime's: every engine's `check_weights(action)` (POST /weights_checker); raises if any engine fails."""
        if not self.engines and self.engine_urls:
            logger.warning("check_weights(%s): the engines of --rollout-external-engine-addrs are not ours; "
                           "nothing is checked", action)
        return self._fan_out("check_weights", action=action)

    # ---- weight pushes (the driver pushes; these bracket it) ---------------------------------------
    def before_weight_update(self) -> None:
        """Called right before a push; returns once no generation of ours is in flight (`_quiet`). Engines the
        health monitor took out are restarted here, so the push that follows brings them to the current weights."""
        self._quiet("push")
        if self.monitor is not None:
            # one that died since the last periodic check; liveness only while memory is released (colocated)
            self.monitor.check_once(while_paused=True, generate=not any(self._released.values()))
            self._restart_dead_engines()

    def after_weight_update(self, weight_version: int) -> None:
        """Called after a push: record the engines' new version; generation comes back unless engine memory is
        still released (colocated: the KV cache comes back after the push)."""
        self.weight_version = int(weight_version)
        set_engine_adapter(request_adapter(self.args))  # with LoRA the engines now hold the trainer's adapter
        self._end_quiet("push")

    # ---- fault tolerance (--use-fault-tolerance) ------------------------------------------------------
    def set_weight_source(self, trainer_ranks: list[Any]) -> None:
        """train.py names its training ranks (Ray actor handles): they are idle while a rollout generates, so
        an engine restarted mid-rollout can be given the current weights by them at once."""
        self._weight_source = list(trainer_ranks)

    def _take_out(self, i: int) -> None:
        """Called by the health monitor's thread: no new requests to engine i, and its server is stopped
        (requests it had in flight fail and are retried through the router on the other engines). If no
        engine is left serving a rollout in progress, the dead ones are brought back now (`_recover_now`)."""
        url = self.engine_urls[i]
        _best_effort(f"deregister {url}", lambda: self.router.remove_worker(url))
        self._log_take_out(i)
        ray.get(self.engines[i].shutdown.remote())
        if self._generating and self._weight_source and len(self.monitor.dead()) == len(self.engines):
            self._recover_now()

    def _log_take_out(self, i: int) -> None:
        """The one line saying why engine i goes (its failure_report), before its server is stopped."""
        try:
            report = ray.get(self.engines[i].failure_report.remote(settle_s=TAKE_OUT_SETTLE_S),
                             timeout=ENGINE_QUERY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the take-out goes on
            report = f"its actor did not answer ({type(e).__name__}: {e})"
        logger.warning("taking engine %d out: %s", i, report or "its server runs but failed the health check")

    def _recover_now(self) -> None:
        """Every engine is dead and a rollout waits on them: restart their servers, have the trainer push the
        version they served (`self.weight_version`), and only then register them with the router, so the
        retried requests are never served by the checkpoint's weights."""
        with self._restart_lock:
            dead = self.monitor.dead()
            if not dead:
                return
            logger.warning("no engine left serving rollout requests; restarting engine(s) %s now and pushing "
                           "weight version %s to them", dead, self.weight_version)
            for i in dead:
                self.engine_urls[i] = ray.get(self.engines[i].init.remote())
            if self.weight_version is not None:
                restarted = [self.engines[i] for i in dead]
                ranks = self._weight_source
                # offloaded while generating (--offload-train): only the weights come back, beside the restarted
                # engine's full memory (the whole training state would not fit a colocated GPU with it)
                ray.get([rank.onload.remote(True) for rank in ranks])
                ray.get([rank.update_weights.remote(restarted, self.weight_version) for rank in ranks])
                if self.args.offload_train:
                    ray.get([rank.offload.remote() for rank in ranks])
            for i in dead:
                self._register_restarted(i, "with the current weights; the rollout's retried requests go to it")

    def _restart_dead_engines(self) -> None:
        with self._restart_lock:
            for i in self.monitor.dead():
                self.engine_urls[i] = ray.get(self.engines[i].init.remote())  # the actor starts a fresh server
                self._register_restarted(i, "the weight push that follows brings it to the current version")

    def _register_restarted(self, i: int, what_next: str) -> None:
        self._released.pop(i, None)  # a fresh server holds all its memory
        self._add_worker(self.engine_urls[i])
        self.monitor.revive(i)
        self._end_quiet_if_all_resumed()
        self.engine_restarts += 1
        logger.warning("engine %d restarted at %s; %s", i, self.engine_urls[i], what_next)

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
        if self.monitor is not None:
            _best_effort("stop health monitor", self.monitor.stop)
        hook = lifecycle_of(self.generate_rollout).shutdown if self.generate_rollout is not None else None
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
    `--router-policy` and `--sglang-router-request-timeout-secs`, which are slime's own flags.

    The router's circuit breaker and its own health checks are off: a worker the router marks open or
    unhealthy (a slow probe while the engine's memory is released, a burst of failures) makes it answer
    503 no_available_workers to requests the engine would have served, and hides the engine's real error.
    Engine health is slime's to judge (`--use-fault-tolerance`'s monitor takes a dead engine out of the router)."""
    out = {"disable_circuit_breaker": True, "disable_health_check": True,
           **args.router_args, "policy": args.router_policy}
    if args.sglang_router_request_timeout_secs is not None:
        out.setdefault("request_timeout_secs", args.sglang_router_request_timeout_secs)
    return out


def _custom_log(hook: Any, *call_args: Any) -> bool:
    """Call a `--custom-(eval-)rollout-log-function-path` plugin (None: unset) with slime's arguments; True when
    it asks for the default metrics of that rollout to be skipped."""
    if hook is None:
        return False
    return bool(hook(*call_args))


def _load_eval_dataset_hooks(args: Any) -> None:
    """Load the reward and generate functions the eval datasets name (they become their samples'
    `custom_rm_path` / `generate_function_path`), so a bad one fails when the RolloutManager starts, not at the
    first eval; `sample_hook` keeps them for the samples."""
    for config in eval_datasets(args):
        for path, flag, where in ((config.custom_rm_path, "--custom-rm-path", "sample.custom_rm_path"),
                                  (config.custom_generate_function_path, "--custom-generate-function-path",
                                   "sample.generate_function_path")):
            if not path:
                continue
            try:
                sample_hook(path, flag, where)
            except (ImportError, AttributeError, TypeError, ValueError) as e:
                raise type(e)(f"eval dataset {config.name!r}: {e}") from e


def _best_effort(what: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - teardown keeps going so every process is reaped
        logger.warning("RolloutManager shutdown: %s failed: %s: %s", what, type(e).__name__, e)
