"""The `--dry-run` report: placement, batch math, model size, memory estimates and warnings, as plain text.

Built from validated arguments only (parse_args has already run every check); reads config.json of
--hf-checkpoint and counts the rows of --prompt-data when --num-rollout has to be derived from --num-epoch.
Nothing is started. The output is deterministic (no timestamps, no host names) so tests can compare it.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

from slime.backends.megatron_utils.args import require_model_args
from slime.config.arg_groups._common import SlimeArgumentError
from slime.config.arg_groups.data import data_parallel_size
from slime.config.plan.layout import Layout, bundle_ranges, compute_layout, describe_bundles, engine_node_problems
from slime.config.plan.memory import (
    EngineMemory,
    Estimate,
    GiB,
    engine_memory,
    fmt_bytes,
    fmt_count,
    state_bytes_per_param,
    training_memory,
    training_parallel,
)
from slime.algorithm.estimators import holds_reference_copy, needs_reference_model
from slime.config.plan.model_size import ModelShape, ModelShapeError, count_params, load_model_shape
from slime.config.plan.prompts import measure_prompts
from slime.utils.backend_specs import engine_spec, train_spec
from slime.utils.data import index_lines, num_rollout_of_epochs, parse_prompt_path
from slime.utils.megatron_roles import megatron_role_overrides, role_args

DEFAULT_GPU_GB = 80.0
MAX_ENGINE_ROWS = 12
COLOCATE_MAX_FRACTION = 0.8


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)


@dataclass
class Plan:
    entry: str
    sections: list[Section]
    warnings: list[str]
    refusals: list[str] = field(default_factory=list)  # the run would not fit: --dry-run and train.py refuse it

    def render(self) -> str:
        if self.refusals:
            head = "arguments are valid, but the plan refuses the run (below); nothing was started"
        else:
            head = "arguments are valid; nothing was started"
        out = [f"slime dry run: {self.entry}: {head} (no Ray, no processes).", ""]
        for s in self.sections:
            out.append(f"== {s.title} ==")
            out.extend(f"  {line}" if line else "" for line in s.lines)
            out.append("")
        out.append("== Warnings ==")
        if self.warnings:
            out.extend(f"  ! {w}" for w in self.warnings)
        else:
            out.append("  none")
        out.append("")
        if self.refusals:
            out.append("== Refused ==")
            out.extend(f"  x {r}" for r in self.refusals)
            out.append("")
        out.append("Estimates are rough (formulas shown; GB = 2^30 bytes). Drop --dry-run to start the run.")
        return "\n".join(out) + "\n"


def kv_table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"{k.ljust(width)}  {v}" for k, v in rows]


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


# ---- derived quantities ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """Longest sample (prompt + response) the run can produce, how it was found, and its prompt part when known."""

    tokens: int | None
    how: str
    prompt: int | None = None


def sample_length(args) -> Lengths:
    if args.rollout_max_context_len:
        return Lengths(args.rollout_max_context_len, f"{args.rollout_max_context_len} (--rollout-max-context-len)",
                       args.rollout_max_prompt_len)
    prompt, response = args.rollout_max_prompt_len, args.rollout_max_response_len
    if prompt and response:
        return Lengths(prompt + response, f"{prompt + response} (--rollout-max-prompt-len {prompt} + "
                                          f"--rollout-max-response-len {response})", prompt)
    if response:
        measured = measure_prompts(args)
        if measured is not None:
            return Lengths(measured.longest + response,
                           f"{measured.longest + response} = --rollout-max-response-len {response} + the longest "
                           f"prompt of the first {measured.rows} rows of --prompt-data, {measured.longest} tokens "
                           "(not bounded: --rollout-max-prompt-len bounds it)", measured.longest)
        return Lengths(response, f"{response} + prompt (--rollout-max-response-len; the prompt is not bounded and "
                                 "was not measured: estimates use the response alone)")
    return Lengths(None, "unknown (no --rollout-max-context-len / --rollout-max-response-len): activation and "
                         "KV estimates need one")


def count_prompt_rows(args) -> int | None:
    """Rows of --prompt-data after its @[start:end] slice, before length filtering (None: not countable)."""
    if not args.prompt_data or not args.rollout_global_dataset:
        return None
    path, rows = parse_prompt_path(args.prompt_data, "--prompt-data")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        n = pq.ParquetFile(path).metadata.num_rows
    else:
        n = len(index_lines(path))
    return len(range(n)[rows]) if rows is not None else n


def resolve_num_rollout(args) -> tuple[int | None, str]:
    if args.num_rollout is not None:
        return args.num_rollout, f"{args.num_rollout} (--num-rollout)"
    epochs = args.num_epoch or 1
    rows = count_prompt_rows(args)
    if rows is None:
        return None, (f"{epochs} epoch(s) × dataset size ÷ {args.rollout_batch_size}: resolved when the data source "
                      "loads")
    n = num_rollout_of_epochs(args, rows)
    return n, (f"{n} = {epochs} epoch(s) × ({rows} rows of --prompt-data // --rollout-batch-size "
               f"{args.rollout_batch_size}) (rows before length filtering; the real count can be lower)")


def micro_batch_tokens(args, length: Lengths) -> float | None:
    """Tokens of one micro-batch on one GPU (padded)."""
    if args.use_dynamic_batch_size:
        return float(args.max_tokens_per_gpu)
    if length.tokens is None:
        return None
    return args.micro_batch_size * length.tokens / training_parallel(args).cp


# ---- the sections ------------------------------------------------------------------------------------------


class _Builder:
    def __init__(self, args, entry: str):
        self.args = args
        # The training sections plan the actor's group, built from its role's args (--megatron-config-path).
        self.train_args = role_args(args, "actor")
        self.entry = entry
        self.warnings: list[str] = []
        self.layout: Layout = compute_layout(args)
        self.length = sample_length(args)
        self.training = not args.debug_rollout_only
        self.gpu_bytes = (args.dry_run_gpu_gb or DEFAULT_GPU_GB) * GiB if args.use_cuda else None
        self.shape: ModelShape | None = None
        self.shape_error: str | None = None
        if args.hf_checkpoint and os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
            try:
                self.shape = load_model_shape(args.hf_checkpoint)
            except (ModelShapeError, KeyError, TypeError, ValueError) as e:
                self.shape_error = f"{args.hf_checkpoint}/config.json: {e}"
        else:
            self.shape_error = "no --hf-checkpoint config.json to read"
        if self.shape_error and args.hf_checkpoint:
            self.warnings.append(f"no model size or memory estimates: {self.shape_error}; point --hf-checkpoint at "
                                 "the model's HF folder")
        t = self.train_args
        self.dp, self.dp_how = data_parallel_size(t) if self.training else (0, "")
        self.samples_per_rank = t.global_batch_size // self.dp if self.training and self.dp else 0
        self.micro_batches = (self.samples_per_rank // t.micro_batch_size
                              if self.training and not t.use_dynamic_batch_size else None)
        self.tokens = micro_batch_tokens(t, self.length)
        self.train_est: Estimate | None = None
        self.refusals: list[str] = []

    # -- run --
    def run(self) -> Section:
        a, lay = self.args, self.layout
        if a.use_cuda and getattr(a, "dry_run_cuda", False):
            devices = "GPU (planned as a GPU run: --dry-run-cuda, or GPU-only flags; this machine has no CUDA)"
        elif a.use_cuda:
            devices = "GPU (CUDA)"
        else:
            devices = ("CPU (no CUDA): bundles are {CPU: 1}; --actor-num-gpus-per-node counts CPU training ranks, "
                       "--rollout-num-gpus CPU engine slots")
        mode = ("asynchronous (train_async.py): rollout k+1 generates while rollout k trains"
                if self.entry == "train_async.py" else "synchronous (train.py): generate, train, push weights")
        train = "none (--debug-rollout-only)"
        if self.training:
            train = f"{a.train_backend}, {len(lay.actor)} rank(s)"
            if lay.critic:
                train += "; PPO critic on the same bundles"
        if lay.external_engines:
            rollout = f"{len(lay.external_engines)} external engine(s) (--rollout-external-engine-addrs)"
        elif not lay.engines:
            rollout = "none (--debug-train-only)"
        else:
            unit = "GPU" if lay.device == "GPU" else "CPU slot"
            rollout = f"{a.rollout_backend}, {len(lay.engines)} engine(s) × {a.rollout_num_gpus_per_engine} {unit}(s)"
            if engine_spec(a).tensor_parallel:
                rollout += f" (SGLang TP {a.rollout_num_gpus_per_engine})"
        if not lay.actor or not (lay.engines or lay.external_engines):
            placement = "one side only: " + ("engines" if not lay.actor else "training ranks")
        elif lay.colocated:
            placement = "colocated (--colocate): engines and training ranks share devices, both resident"
        else:
            placement = "disaggregated: engines and training ranks on separate devices"
        handed = [what for flag, what in ((a.offload_train, "training state to host memory while the engines generate"),
                                          (a.offload_rollout, "engines release weights + KV cache while training"))
                  if flag]
        offload = "; ".join(handed) if handed else "none: training state and engines stay resident"
        algo = a.advantage_estimator + (("; the KL term's reference is the frozen base (adapters off)"
                                         if getattr(a, "lora_rank", 0) else "; frozen reference model for the KL term")
                                        if needs_reference_model(self.train_args) else "")
        rows = [("mode", mode), ("devices", devices), ("training", train), ("rollout", rollout),
                ("placement", placement), ("offload", offload), ("algorithm", algo)]
        if a.megatron_config_path is not None:
            rows.append(("role overrides", self._role_overrides()))
        return Section("Run", kv_table(rows))

    def _role_overrides(self) -> str:
        path = self.args.megatron_config_path
        roles = ["actor", "critic"] if self.layout.critic else ["actor"]
        said = "; ".join(f"{role}: {megatron_role_overrides(path, role) or 'none'}" for role in roles)
        return f"--megatron-config-path {path}: {said} (the training sections below plan the actor's)"

    # -- placement --
    def placement(self) -> Section:
        a, lay = self.args, self.layout
        bundle = "{GPU: 1, CPU: 1}" if lay.device == "GPU" else "{CPU: 1}"
        if lay.device == "GPU":
            nodes = f"sorted by (node ip, GPU id); nodes of {lay.node_size} GPUs assumed (--num-gpus-per-node)"
        else:
            nodes = "on one node (a local CPU cluster assumed)"
        lines = [f"placement group: {lay.total_bundles} bundle(s) {bundle}, PACK, {nodes}", ""]
        rows = []
        if lay.actor:
            par = training_parallel(a)
            how = (f"TP {par.tp} × PP {par.pp} × CP {par.cp} × DP {par.dp}" + (f", EP {par.ep}" if par.ep > 1 else "")
                   if train_spec(a).megatron_parallelism else f"FSDP over {len(lay.actor)} rank(s)")
            rows.append(["actor", bundle_ranges(lay.actor), describe_bundles(lay, lay.actor), how])
            if lay.critic:
                rows.append(["critic", bundle_ranges(lay.actor), "same as actor", "PPO critic group"])
        if lay.rollout and lay.engines:
            note = self._colocated_note() if lay.colocated else "own devices"
            rows.append(["rollout", bundle_ranges(lay.rollout), describe_bundles(lay, lay.rollout), note])
            shown = lay.engines if len(lay.engines) <= MAX_ENGINE_ROWS else lay.engines[:MAX_ENGINE_ROWS - 2]
            for e in shown:
                rows.append(self._engine_row(e))
            if len(shown) < len(lay.engines):
                rows.append(["...", "", f"{len(lay.engines) - len(shown) - 1} more engine(s), same pattern", ""])
                rows.append(self._engine_row(lay.engines[-1]))
        for addr in lay.external_engines:
            rows.append(["engine", "-", addr, "external (not launched)"])
        lines += table(["role", "bundles", "where", "notes"], rows)
        problems = engine_node_problems(lay)
        if problems:
            e, node = a.rollout_num_gpus_per_engine, lay.node_size
            if e <= node and node % e:
                fix = f"use a --rollout-num-gpus-per-engine that divides --num-gpus-per-node {node}"
            else:
                fix = (f"make the actor's GPU count (--actor-num-nodes × --actor-num-gpus-per-node = {len(lay.actor)}) "
                       f"a multiple of {min(e, node)}, or use --colocate")
            self.warnings.append(f"{'; '.join(problems)}: SGLang needs an engine's GPUs on one node (whole nodes "
                                 f"when it is wider than --num-gpus-per-node {node}); {fix}")
        if lay.device == "GPU" and a.actor_num_nodes > 1 and a.actor_num_gpus_per_node != a.num_gpus_per_node:
            self.warnings.append(
                f"--actor-num-gpus-per-node {a.actor_num_gpus_per_node} differs from --num-gpus-per-node "
                f"{a.num_gpus_per_node}: PACK fills whole nodes, so the actor's ranks may not sit "
                f"{a.actor_num_gpus_per_node} per node as asked; set --num-gpus-per-node to your nodes' GPU count")
        return Section("Placement", lines)

    def _colocated_note(self) -> str:
        """Which rollout bundles hold a training rank too (a --rollout-num-gpus other than the actor's count puts
        the engines on a subset or a superset of its bundles)."""
        lay = self.layout
        shared = [b for b in lay.rollout if b in set(lay.actor)]
        own = [b for b in lay.rollout if b not in set(lay.actor)]
        idle = [b for b in lay.actor if b not in set(lay.rollout)]
        note = "shared with actor (--colocate)"
        if own:
            note = f"{bundle_ranges(shared)} shared with actor (--colocate), {bundle_ranges(own)} engines only"
        if idle:
            note += f"; actor bundles {bundle_ranges(idle)} hold no engine"
        return note

    def _engine_row(self, e) -> list[str]:
        a = self.args
        note = f"TP {len(e.bundles)}" if engine_spec(a).tensor_parallel else f"{a.rollout_backend} engine"
        if e.nnodes > 1:
            note += f", {e.nnodes} nodes: one actor per node on bundles {', '.join(map(str, e.node_actor_bundles()))}"
        return [f"engine {e.rank}", bundle_ranges(e.bundles), describe_bundles(self.layout, e.bundles), note]

    # -- batches --
    def batches(self) -> Section:
        a = self.args
        num_rollout, how_rollout = resolve_num_rollout(a)
        samples = a.rollout_batch_size * a.n_samples_per_prompt
        rows = [
            ("rollouts", how_rollout),
            ("samples per rollout", f"{samples} = --rollout-batch-size {a.rollout_batch_size} × "
                                    f"--n-samples-per-prompt {a.n_samples_per_prompt}"),
        ]
        if a.over_sampling_batch_size > a.rollout_batch_size:
            rows.append(("over-sampling", f"{a.over_sampling_batch_size} prompt groups in flight "
                                          "(--over-sampling-batch-size) until enough pass the filter"))
        rows.append(("max sample length", self.length.how))
        if self.training:
            t = self.train_args
            rows.append(("optimizer steps", f"{t.num_steps_per_rollout} per rollout of --global-batch-size "
                                            f"{t.global_batch_size} samples"
                         + (f"; {num_rollout * t.num_steps_per_rollout} in the run" if num_rollout else "")))
            rows.append(("data-parallel size", f"{self.dp} ({self.dp_how})"))
            rows.append(("per DP rank per step",
                         f"{self.samples_per_rank} samples = {t.global_batch_size} ÷ DP {self.dp}"))
            rows.append(("micro-batches", self._micro_batch_line()))
        if self.layout.engines or self.layout.external_engines:
            n = len(self.layout.engines) or len(self.layout.external_engines)
            rows.append(("requests in flight", f"≤ {a.sglang_server_concurrency * n} = --sglang-server-concurrency "
                                               f"{a.sglang_server_concurrency} × {n} engine(s)"))
        if self.entry == "train_async.py":
            rows.append(("async", f"--async-buffer-size {a.async_buffer_size} rollout(s) ahead; weights pushed every "
                                  f"{a.update_weights_interval} rollout(s)"))
        return Section("Batches", kv_table(rows))

    def _micro_batch_line(self) -> str:
        a = self.train_args
        if not a.use_dynamic_batch_size:
            return (f"{self.micro_batches} per step per DP rank = {self.samples_per_rank} ÷ --micro-batch-size "
                    f"{a.micro_batch_size}")
        line = f"dynamic: packed to ≤ --max-tokens-per-gpu {a.max_tokens_per_gpu} padded tokens each"
        length = self.length.tokens
        if length:
            per = a.max_tokens_per_gpu // length
            if per >= 1:
                line += (f"; at full length ({length} tokens) {per} sample(s) each, up to "
                         f"{math.ceil(self.samples_per_rank / per)} per step per DP rank (fewer for shorter samples)")
            else:
                self.warnings.append(
                    f"--max-tokens-per-gpu {a.max_tokens_per_gpu} is below the longest sample ({length} tokens): such "
                    f"a sample still forms a micro-batch of its own, over the budget; raise --max-tokens-per-gpu to "
                    f"≥ {length} or lower the length limits")
        return line

    # -- model --
    def model(self) -> Section:
        s = self.shape
        if s is None:
            return Section("Model", [f"skipped: {self.shape_error}"])
        counts = count_params(s)
        attn = (f"MLA (q_lora_rank {s.q_lora_rank}, kv_lora_rank {s.kv_lora_rank}, qk {s.qk_nope_head_dim}+"
                f"{s.qk_rope_head_dim}, v {s.v_head_dim}), {s.num_heads} heads" if s.mla else
                f"{s.num_heads} heads, {s.num_kv_heads} kv heads (query groups), head_dim {s.head_dim}")
        rows = [
            ("config", f"{self.args.hf_checkpoint}/config.json (model_type {s.model_type or '?'})"),
            ("shape", f"hidden {s.hidden_size}, {s.num_layers} layers, ffn {s.intermediate_size}, "
                      f"vocab {s.vocab_size}, embeddings {'tied' if s.tie_word_embeddings else 'untied'}"),
            ("attention", attn),
        ]
        if s.num_experts:
            shared = f", shared ffn {s.shared_expert_intermediate_size}" if s.shared_expert_intermediate_size else ""
            rows.append(("MoE", f"{s.num_moe_layers} of {s.num_layers} layers: {s.num_experts} experts (top-"
                                f"{s.experts_per_token}), expert ffn {s.moe_intermediate_size}{shared}"))
        params = f"{fmt_count(counts.total)} ({counts.total:,}): embedding {fmt_count(counts.embedding)}"
        params += f", output {fmt_count(counts.output)}" if counts.output else ", output tied"
        params += f", layers {fmt_count(counts.layers_dense + counts.layers_expert)}"
        if s.num_experts:
            params += f" of which routed experts {fmt_count(counts.layers_expert)}"
        if counts.vision:
            params += f", vision tower {fmt_count(counts.vision)}"
        rows.append(("parameters", params))
        if s.num_experts:
            rows.append(("active per token", fmt_count(counts.active)))
        if s.quant_method:
            rows.append(("checkpoint", f"quantization_config: {s.quant_method}"))
        return Section("Model", kv_table(rows))

    # -- training memory --
    def training_memory(self) -> tuple[Section, Estimate | None]:
        a = self.train_args
        title = "Training memory per device (estimate)"
        if not self.training:
            return Section(title, ["none (--debug-rollout-only)"]), None
        if self.shape is None:
            return Section(title, [f"skipped: {self.shape_error}"]), None
        est = training_memory(a, self.shape, self.tokens, self.micro_batches, holds_reference_copy(a))
        lines = table(["item", "size", "how"], [[i.name, fmt_bytes(i.bytes), i.how] for i in est.items])
        lines.append(f"total: {fmt_bytes(est.total)}" + self._limit_text())
        if self.tokens is None:
            lines.append("activations not estimated: " + self.length.how)
        lines += [f"note: {n}" for n in est.notes]
        if self.layout.critic:
            lines.append("note: the PPO critic is a model of the same size on the same devices, resident next to the "
                         "actor while training: count it twice")
        if self.gpu_bytes and est.total > self.gpu_bytes:
            self.warnings.append(f"estimated training memory {fmt_bytes(est.total)} > {fmt_bytes(self.gpu_bytes)} per "
                                 f"GPU: {'; '.join(self._training_fixes(est)) or 'use more or larger GPUs'}")
        hint = self._token_budget_hint(est)
        if hint:
            lines.append(hint)
        return Section(title, lines), est

    def _token_budget_hint(self, est: Estimate) -> str | None:
        """Fixed micro-batches far below what the GPU holds: the token budget that would fit (by this estimate, at
        most 80% of the GPU), when the training phase has the GPU to itself and that budget packs ≥ 2x the tokens."""
        a, length = self.train_args, self.length.tokens
        colocated_engines = self.layout.colocated and not a.offload_rollout
        if a.use_dynamic_batch_size or not self.gpu_bytes or not length or colocated_engines or self.tokens is None:
            return None
        room, best, per = 0.8 * self.gpu_bytes, None, 2 * a.micro_batch_size
        if est.total > room:
            return None
        while per <= self.samples_per_rank:
            after = self._estimate_with(use_dynamic_batch_size=True, max_tokens_per_gpu=per * length)
            if after > room:
                break
            best, per = (per * length, after), per * 2
        if best is None:
            return None
        return (f"hint: micro-batches of --micro-batch-size {a.micro_batch_size} ({int(self.tokens)} tokens) leave "
                f"room: --use-dynamic-batch-size --max-tokens-per-gpu {best[0]} packs up to {best[0] // length} "
                f"full-length samples each (→ {fmt_bytes(best[1])}); fewer, larger micro-batches usually train faster "
                "(GRPO's 0.6B step on an H100: train 2.76 s at 16 samples each, 1.20 s at 20480 tokens)")

    def _limit_text(self) -> str:
        if self.gpu_bytes is None:
            return (" (host RAM per rank; CPU run, no limit checked: --dry-run-cuda [--dry-run-gpu-gb N] plans a "
                    "GPU run)")
        return f" of {fmt_bytes(self.gpu_bytes)} per GPU (--dry-run-gpu-gb)"

    def _estimate_with(self, **changes) -> float:
        args = argparse.Namespace(**{**vars(self.train_args), **changes})
        tokens = micro_batch_tokens(args, self.length)
        micro = self.micro_batches
        if "micro_batch_size" in changes and micro is not None:
            micro = self.samples_per_rank // changes["micro_batch_size"]
        return training_memory(args, self.shape, tokens, micro, holds_reference_copy(args)).total

    def _training_fixes(self, est: Estimate) -> list[str]:
        a, s = self.train_args, self.shape
        fixes = []

        def offer(text: str, **changes):
            after = self._estimate_with(**changes)
            if after < est.total * 0.97:
                fixes.append(f"{text} (→ {fmt_bytes(after)})")

        if train_spec(a).megatron_parallelism:
            par = training_parallel(a)
            if not a.use_distributed_optimizer and par.dp * par.cp > 1:
                offer("drop --no-use-distributed-optimizer", use_distributed_optimizer=True)
            if a.recompute_granularity != "full" and self.tokens:
                offer("add --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                      recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            tp2, pp2, ep2 = par.tp * 2, par.pp * 2, par.ep * 2
            etp = tp2 if par.etp == par.tp else par.etp
            if tp2 <= a.num_gpus_per_node and self._parallel_ok(par.world, tp2, par.pp, par.cp, par.ep, etp):
                offer(f"raise --tensor-model-parallel-size to {tp2}", tensor_model_parallel_size=tp2,
                      expert_tensor_parallel_size=etp, sequence_parallel=True)
            if pp2 <= s.num_layers and self._parallel_ok(par.world, par.tp, pp2, par.cp, par.ep, par.etp):
                uneven = "" if s.num_layers % pp2 == 0 else (
                    f" with --decoder-first/last-pipeline-num-layers splitting the {s.num_layers} layers")
                offer(f"raise --pipeline-model-parallel-size to {pp2}{uneven}", pipeline_model_parallel_size=pp2,
                      decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
            if s.num_experts and self._parallel_ok(par.world, par.tp, par.pp, par.cp, ep2, par.etp):
                offer(f"raise --expert-model-parallel-size to {ep2}", expert_model_parallel_size=ep2)
            offer(f"double the training GPUs: --actor-num-nodes {2 * a.actor_num_nodes} (more data parallelism "
                  "to shard the optimizer over)" if a.use_distributed_optimizer else
                  f"double the training GPUs (--actor-num-nodes {2 * a.actor_num_nodes}) without "
                  "--no-use-distributed-optimizer", actor_num_nodes=2 * a.actor_num_nodes, use_distributed_optimizer=True)
        else:
            world = len(self.layout.actor)
            offer(f"double the training ranks to {2 * world} (FSDP shards the state over all of them)",
                  actor_num_gpus_per_node=2 * a.actor_num_gpus_per_node)
            fixes.append("--train-backend megatron (tensor/pipeline parallelism, activation recompute)")
        if a.use_dynamic_batch_size and a.max_tokens_per_gpu > 1:
            half = a.max_tokens_per_gpu // 2
            offer(f"lower --max-tokens-per-gpu to {half}", max_tokens_per_gpu=half)
        elif not a.use_dynamic_batch_size and a.micro_batch_size > 1:
            offer(f"lower --micro-batch-size to {a.micro_batch_size // 2}", micro_batch_size=a.micro_batch_size // 2)
        floor = self._state_floor()
        if floor:
            fixes.append(floor)
        return fixes

    def _parallel_ok(self, world: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> bool:
        s = self.shape
        if world % (tp * pp * cp) or world % (etp * ep * pp):
            return False
        if s.num_heads % tp or (not s.mla and s.num_kv_heads % tp):
            return False
        return not s.num_experts or s.num_experts % ep == 0

    def _state_floor(self) -> str | None:
        """Weights + gradients + optimizer (+ reference) of the whole model, perfectly sharded: a lower bound on
        the training GPUs, whatever the parallel layout."""
        total = count_params(self.shape).total
        per = state_bytes_per_param(self.train_args, holds_reference_copy(self.train_args))
        need = math.ceil(total * per / self.gpu_bytes)
        if need <= len(self.layout.actor):
            return None
        return (f"the model's training state alone ({per} B × {fmt_count(total)} params = {fmt_bytes(total * per)}) "
                f"needs ≥ {need} GPUs of {fmt_bytes(self.gpu_bytes)} however it is sharded, and the actor has "
                f"{len(self.layout.actor)}")

    # -- engines --
    def engine_memory(self) -> tuple[Section, EngineMemory | None]:
        a, s = self.args, self.shape
        title = "Engine memory per device (estimate)"
        if not self.layout.engines:
            return Section(title, ["no engines launched here"]), None
        if s is None:
            return Section(title, [f"skipped: {self.shape_error}"]), None
        self._check_engine_tp()
        mem, kv_how = engine_memory(a, s, self.gpu_bytes, self.length.prompt, self.length.tokens)
        rows = [("weights", f"{fmt_bytes(mem.weights)} = {fmt_count(count_params(s).total)} params × "
                            f"{mem.weight_bytes_per_param} B ÷ TP {mem.tp}")]
        rows.append(("KV per token", f"{fmt_bytes(mem.kv_bytes_per_token)} per {self.layout.device} = {kv_how}"))
        if mem.slots is not None:
            rows += self._slot_rows(mem)
            if self.layout.colocated:
                rows += self._check_colocated(mem)
            return Section(title, kv_table(rows)), mem
        if mem.fraction is None:
            if engine_spec(a).kv_cache != "slots":
                why = "CPU run"
            elif self.gpu_bytes is None:
                why = "the hf engine allocates its KV cache as requests arrive"
            else:
                why = "the hf engine's KV slots need the sample length: " + self.length.how
            rows.append(("KV cache", f"no static pool ({why})"))
            return Section(title, kv_table(rows)), mem
        given = "--sglang-mem-fraction-static" if mem.fraction_given else "SGLang's default, assumed"
        rows.append(("static pool", f"{fmt_bytes(mem.static)} = mem_fraction_static {mem.fraction} ({given}) × "
                                    f"{fmt_bytes(self.gpu_bytes)}"))
        rows.append(("KV cache", f"{fmt_bytes(max(mem.kv_budget, 0))} = static pool − weights"))
        capacity = f"{mem.kv_tokens:,} tokens per engine"
        if self.length.tokens and mem.kv_tokens:
            capacity += f" = {mem.kv_tokens // self.length.tokens:,} full-length samples of {self.length.tokens} tokens"
        rows.append(("KV capacity", capacity))
        if self.layout.colocated:
            rows += self._check_colocated(mem)
        if mem.kv_budget <= 0:
            self.warnings.append(
                f"engine weights {fmt_bytes(mem.weights)} per GPU do not fit the static pool {fmt_bytes(mem.static)} "
                f"(mem_fraction_static {mem.fraction} × {fmt_bytes(self.gpu_bytes)}): no room for a KV cache; "
                + self._engine_fix(mem))
        elif self.length.tokens and mem.kv_tokens < self.length.tokens:
            self.warnings.append(
                f"engine KV cache holds {mem.kv_tokens:,} tokens, less than one full-length sample "
                f"({self.length.tokens} tokens): " + self._engine_fix(mem))
        return Section(title, kv_table(rows)), mem

    def _slot_rows(self, mem: EngineMemory) -> list[tuple[str, str]]:
        """The hf engine's KV slots and its peak (slime/config/plan/memory.py, hf_slot_cache)."""
        a, slots, per = self.args, mem.slots, fmt_bytes(mem.kv_bytes_per_token)
        in_flight = a.over_sampling_batch_size * a.n_samples_per_prompt
        rows = [("KV slot rows", f"{slots.rows} = min(--sglang-server-concurrency {a.sglang_server_concurrency}, "
                                 f"{in_flight} samples in flight) rounded up to the engine's row buckets"),
                ("KV slots", f"{fmt_bytes(slots.bytes)} = {slots.rows} rows × {slots.columns} columns × {per} (columns "
                             f"double until the longest sample, {self.length.tokens} tokens, fits)")]
        if slots.previous:
            rows.append(("KV slots, growing", f"{fmt_bytes(slots.peak)} = {slots.rows} rows × ({slots.columns} + "
                                              f"{slots.previous}) columns × {per}: the old buffer and the new one "
                                              "while it copies (the engine's allocator keeps the freed one)"))
        rows.append(("engine peak", f"{fmt_bytes(mem.peak)} = weights + KV slots"
                     + (", growing" if slots.previous else "") + " (held until the engine releases its KV cache)"))
        if mem.peak > self.gpu_bytes:
            self.warnings.append(
                f"the hf engine alone needs {fmt_bytes(mem.peak)} > {fmt_bytes(self.gpu_bytes)} per GPU: lower "
                "--sglang-server-concurrency or --rollout-max-response-len, or use --rollout-backend sglang")
        return rows

    def _engine_fix(self, mem: EngineMemory) -> str:
        a = self.args
        for tp in range(mem.tp + 1, a.rollout_num_gpus + 1):
            if a.rollout_num_gpus % tp or not self._engine_tp_ok(tp):
                continue
            weights = mem.weights * mem.tp / tp
            if mem.static - weights > mem.kv_bytes_per_token * (self.length.tokens or 1) * 4:  # ≥ 4 full samples
                return (f"raise --rollout-num-gpus-per-engine to {tp} (weights {fmt_bytes(weights)} per GPU)"
                        + ("" if mem.fraction >= 0.9 else " or raise --sglang-mem-fraction-static"))
        return "raise --sglang-mem-fraction-static, or give the engines more GPUs (--rollout-num-gpus)"

    def _engine_tp_ok(self, tp: int) -> bool:
        s = self.shape
        if s.num_heads % tp:
            return False
        if s.mla:
            return True
        g = s.num_kv_heads
        return g % tp == 0 if g >= tp else tp % g == 0

    def _check_engine_tp(self) -> None:
        a, s = self.args, self.shape
        tp = a.rollout_num_gpus_per_engine
        if not engine_spec(a).tensor_parallel or self._engine_tp_ok(tp):
            return
        valid = [t for t in range(1, a.rollout_num_gpus + 1) if self._engine_tp_ok(t)]
        near = " or ".join(str(t) for t in _nearest(tp, valid)) or "1"
        if s.num_heads % tp:
            what = f"the {s.num_heads} attention heads (num_attention_heads)"
        else:
            what = f"the {s.num_kv_heads} query groups (num_key_value_heads), nor is a multiple of them"
        self.warnings.append(f"--rollout-num-gpus-per-engine {tp} (SGLang TP) does not divide {what} of "
                             f"{a.hf_checkpoint}/config.json: SGLang refuses to start; try {near} "
                             "(--rollout-num-gpus a multiple of it)")

    def _check_colocated(self, mem: EngineMemory) -> list[tuple[str, str]]:
        """The phases of a colocated GPU as the loop runs them (slime/ray/handoff.py): with --offload-rollout the
        engines hold nothing while training and only their weights during the push; with --offload-train the
        training state is in host memory while the engines generate. The engines hold `mem.peak` otherwise (SGLang's
        static pool; the hf engine's weights and KV slots). A phase over the GPU in which both sides are resident is
        refused (`refusals`): that sum is what the handoff exists for. Returns the report rows."""
        a = self.args
        if mem.fraction is not None and mem.fraction > COLOCATE_MAX_FRACTION and not a.offload_rollout:
            self.warnings.append(
                f"--colocate with mem_fraction_static {mem.fraction}"
                + ("" if mem.fraction_given else " (SGLang's default, assumed)")
                + " and --no-offload-rollout: the training processes keep their CUDA context and cached blocks on "
                  "the GPU while the engines run; slime's colocated scripts use --sglang-mem-fraction-static 0.7")
        train = self.train_est
        if train is None:
            return []
        engine_what = (f"static pool {fmt_bytes(mem.peak)}" if mem.fraction is not None
                       else f"weights + KV slots {fmt_bytes(mem.peak)}")
        resident = sum(i.bytes for i in train.items if i.name not in ("activations", "logits"))
        engines_while_training = 0.0 if a.offload_rollout else mem.peak
        train_while_generating = 0.0 if a.offload_train else resident
        during_train = train.total + engines_while_training
        during_gen = mem.peak + train_while_generating
        rows = [
            ("colocated, training", f"{fmt_bytes(during_train)} = training {fmt_bytes(train.total)} + engines "
             + ("released (--offload-rollout)" if a.offload_rollout else engine_what)),
            ("colocated, generating", f"{fmt_bytes(during_gen)} = engines {engine_what} + training "
             + ("state in host memory (--offload-train)" if a.offload_train else f"state {fmt_bytes(resident)}")),
        ]  # fmt: skip
        if a.offload_rollout:  # with --offload-train the trainers keep only their weights for the push
            pushed = train.get("weights") if a.offload_train else resident
            during_push = pushed + mem.weights
            rows.append(("colocated, pushing weights", f"{fmt_bytes(during_push)} = training "
                         + (f"weights {fmt_bytes(pushed)} (the rest offloaded)" if a.offload_train
                            else f"state {fmt_bytes(resident)}")
                         + f" + engine weights {fmt_bytes(mem.weights)} (KV cache still released)"))
        gpu = fmt_bytes(self.gpu_bytes)
        if during_train > self.gpu_bytes:
            if a.offload_rollout:
                self.warnings.append(f"colocated, while training: {fmt_bytes(during_train)} > {gpu}: train on more "
                                     "GPUs or lower the training memory (fixes above)")
            else:
                self.refusals.append(
                    f"colocated, while training: training {fmt_bytes(train.total)} + engines {engine_what} = "
                    f"{fmt_bytes(during_train)} > {gpu} per GPU: drop --no-offload-rollout, "
                    + self._engine_shrink(mem, self.gpu_bytes - train.total)
                    + " (with --no-offload-rollout the engines keep their memory while training; the memory handoff "
                      "releases it)")
        if during_gen > self.gpu_bytes and not a.offload_train:  # the engines alone: warned in their own rows
            self.refusals.append(
                f"colocated, while generating: engines {engine_what} + training state {fmt_bytes(resident)} = "
                f"{fmt_bytes(during_gen)} > {gpu} per GPU: drop --no-offload-train, "
                + self._engine_shrink(mem, self.gpu_bytes - resident)
                + " (with --no-offload-train the training state stays on the GPU while the engines generate; the "
                  "memory handoff moves it to host memory)")
        return rows

    def _engine_shrink(self, mem: EngineMemory, room: float) -> str:
        """How to make the engines fit in `room` bytes per GPU: SGLang's fraction that fits, or the hf engine's
        smaller running batch."""
        if mem.fraction is not None:
            fraction = max(0.05, math.floor(room / self.gpu_bytes * 20) / 20)
            return f"or lower --sglang-mem-fraction-static to {fraction:.2f}"
        left = fmt_bytes(max(room - mem.weights, 0))
        return (f"or lower --sglang-server-concurrency ({mem.slots.rows} KV slot rows of the hf engine now, needing "
                f"{fmt_bytes(mem.peak - mem.weights)} where {left} is left) or --rollout-batch-size / "
                "--rollout-max-response-len")

    def _check_training_model(self) -> None:
        """What the megatron ranks would refuse at start-up that parse_args cannot see: no MODEL_ARGS, and
        (without MODEL_ARGS to cross-check) a TP size that does not divide config.json's heads."""
        a, s = self.train_args, self.shape
        if not self.training or not train_spec(a).model_from_megatron_flags:
            return
        try:
            require_model_args(a)
        except SlimeArgumentError as e:
            self.warnings.append(f"{e} (the training ranks would fail at start-up)")
        if s is None:
            return
        par = training_parallel(a)
        groups = None if s.mla else s.num_kv_heads
        for n, what in ((s.num_heads, "attention heads (num_attention_heads)"),
                        (groups, "query groups (num_key_value_heads)")):
            if n and n % par.tp:
                valid = [t for t in range(1, par.world + 1) if s.num_heads % t == 0
                         and (groups is None or groups % t == 0) and par.world % (t * par.pp * par.cp) == 0]
                near = " or ".join(str(t) for t in _nearest(par.tp, valid)) or "1"
                self.warnings.append(f"--tensor-model-parallel-size {par.tp} does not divide the {n} {what} of "
                                     f"{a.hf_checkpoint}/config.json: try {near}")
                return

    def build(self) -> Plan:
        sections = [self.run(), self.placement(), self.batches(), self.model()]
        self._check_training_model()
        train_section, self.train_est = self.training_memory()
        sections.append(train_section)
        sections.append(self.engine_memory()[0])
        return Plan(self.entry, sections, self.warnings, self._enforced_refusals())

    def memory_refusals(self) -> list[str]:
        """The refusals of the memory sections alone (train.py's check before Ray starts)."""
        self.train_est = self.training_memory()[1]
        self.engine_memory()
        return self._enforced_refusals()

    def _enforced_refusals(self) -> list[str]:
        """The refusals, or none with --skip-memory-check (they are then warnings)."""
        if self.args.skip_memory_check:
            self.warnings += [f"{r} (not refused: --skip-memory-check)" for r in self.refusals]
            return []
        return self.refusals


def _nearest(value: int, candidates: list[int]) -> list[int]:
    below = [c for c in candidates if c < value]
    above = [c for c in candidates if c > value]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def build_plan(args, entry: str = "train.py") -> Plan:
    return _Builder(args, entry).build()


def memory_refusals(args, gpu_bytes: float) -> list[str]:
    """What the plan refuses about memory (a colocated GPU both sides would overfill) for GPUs of `gpu_bytes`."""
    builder = _Builder(args, "train.py")
    builder.gpu_bytes = gpu_bytes
    return builder.memory_refusals()
