"""Per-device memory estimates of a run: training ranks (megatron or fsdp) and rollout engines.

Rough by design (the report says so); every item carries the formula it was computed with.

Training, megatron (the largest pipeline stage is reported):
- weights: params of the stage ÷ TP (routed experts ÷ EP × ETP) × 2 B (bf16/fp16) or 4 B (fp32);
- gradients: same count × 4 B with --accumulate-allreduce-grads-in-fp32 (on with --bf16 unless
  --grad-reduce-in-bf16) or fp32 training; 16-bit buffers: 2 B, plus the 4 B fp32 copies the optimizer step makes of
  them (megatron-core's `.float()` of each main_grad shard), counted as 6 B;
- optimizer: Adam fp32 m and v + fp32 master weights = 12 B/param in bf16/fp16 (8 B in fp32; SGD 8 / 4 B),
  ÷ DP×CP (experts: ÷ expert-DP) with the distributed optimizer (the Megatron trainer's default);
- LoRA (--lora-rank): the base has no gradients or optimizer state; the stage's adapters (plan/lora_size.py) have
  weights, gradients and optimizer state as above;
- reference model (a KL term): another copy of the weights; the teacher of `--use-opd --opd-type megatron`
  (the student's architecture and layout): one more;
- activations: what one decoder layer of the local layer spec keeps for its backward, per token of a
  micro-batch of T tokens (`layer_activation_elements`, × the activation dtype's bytes): the inputs of the two
  norms and of the two first projections (4h; ÷TP only with --sequence-parallel, + h per extra norm of a
  sandwich-norm layer), the fused q/k/v output (q + 2kv, which the value view keeps whole), the query (and with
  q/k norms its unnormalised copy), the key and the output the flash kernel keeps (q + kv) (packed micro-batches
  under --attention-kernel cudnn: the padded query, key, value and output, 2q + 2kv at no padding, the gathered
  output, q, and the fused output only with q/k norms, whose inputs are views of it; the plan takes the larger of
  that and flash's, which sequences of one length, viewed as padded rows, and too uneven ones keep), the MLP's
  gate/up output and its down projection's input (3·ffn; an MoE layer: top-k × (h + 3·expert ffn ÷ ETP) per token
  the rank's experts see, + 3·shared ffn, + the router's scores and top-k probabilities), all but the first part
  ÷ TP. The fp32 statistics (an RMSNorm's inverse RMS per row, flash attention's log-sum-exp per head) are left
  out. Counted on the layer itself: tests/e2e_cpu/test_activation_plan.py tallies what autograd keeps in a Megatron
  layer on CPU (norms, attention and rotation as slime's CUDA kernels keep them) and checks this formula against it,
  on each attention route, to the byte. It is ~35% above Korthikanti et al.'s 34·T·h for Qwen3-4B, whose GQA,
  SwiGLU and q/k norms that formula (GPT's layer, dropout masks) does not describe. × the stage's layers × the
  micro-batches 1F1B keeps in flight (PP − stage). --recompute-granularity full keeps 2·T·h per layer (per group
  of --recompute-num-layers with `uniform`) plus one group's full activations. Selective recompute
  (--recompute-activations) only drops the attention-score term flash attention never stores. Multi-latent
  attention is estimated alike (its latents and their norms' inputs, the up-projection's output, query, key, value
  and output), not counted on a layer;
- logits: T × padded vocab ÷ TP × 8 B (the bf16 logits, their gradient and the fp32 chunks of the log-prob pass,
  measured at 5.9 B on CPU), last stage only.

Training, fsdp (this repo's backend: FSDP2 over all ranks, fp32 master shards, AdamW, no recompute):
weights, gradients (fp32) and AdamW state ÷ ranks = 16 B/param ÷ ranks (LoRA: 4 B/param of the frozen base, the
adapters 16 B/param); the gathered embedding/output
layer and two decoder layers in the compute dtype; a KL reference model's fp32 shards, and the OPD teacher's
(`--opd-type megatron`: its own parameter count when --opd-teacher-load is an HF folder); activations by Korthikanti
et al.'s 34·T·h bytes per layer (GPT's layer; not counted on the HF layer as the Megatron term is; fp32 on CPU
doubles them).

Engines (SGLang): weights = params × bytes ÷ TP (1 B for an fp8 checkpoint, else 2 B); the static pool
is mem_fraction_static × GPU memory (SGLang's own default depends on the GPU and TP: 0.9 is assumed when
--sglang-mem-fraction-static is not given) and the KV cache gets what the weights leave of it. KV bytes per
token per GPU: 2 × layers × max(1, kv_heads ÷ TP) × head_dim × bytes (MLA: layers × (kv_lora_rank +
rope_dim) × bytes, not split by TP).

Engines (hf, on CUDA): no static pool; the weights plus the KV slots (slime/backends/hf_engine/slots.py), which
hold one row per running request (the rows rounded up to its row buckets, at most --sglang-server-concurrency)
and grow their columns by doubling until the longest sample fits (`grown_columns`). While the last growth copies,
the old and the new buffers are both allocated, and the engine's caching allocator keeps the freed one until the
engine releases its KV cache: weights + rows × (last + previous columns) × KV bytes per token is what the engine
holds from the first full-length rollout on. Decode activations, logits and the CUDA graphs' pool are small next to
it and not counted; a model the slots cannot serve (sliding-window layers) uses a dynamic cache, estimated alike.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from slime.backends.hf_engine.slots import bucket_rows, grown_columns
from slime.backends.megatron_utils.args import padded_vocab_size
from slime.config.arg_groups._common import SlimeArgumentError
from slime.config.arg_groups.megatron import pipeline_layer_split
from slime.config.plan.lora_size import fsdp_adapter_params, megatron_adapter_params_per_layer
from slime.config.plan.model_size import ModelShape, count_params, embedding_params, layer_params, load_model_shape
from slime.utils.backend_specs import engine_spec, train_spec

GiB = 2**30
DEFAULT_MEM_FRACTION_STATIC = 0.9


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    how: str


@dataclass
class Estimate:
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(i.bytes for i in self.items)

    def get(self, name: str) -> float:
        return sum(i.bytes for i in self.items if i.name == name)


def fmt_bytes(n: float) -> str:
    if n >= 1024 * GiB:
        return f"{n / (1024 * GiB):.1f} TB"
    if n >= GiB / 10:
        return f"{n / GiB:.1f} GB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MB"
    return f"{n / 2**10:.1f} KB"


def fmt_count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))


# ---- training ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def expert_dp(self) -> int:
        return max(1, self.world // (self.etp * self.ep * self.pp))


def training_parallel(args) -> Parallel:
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if not train_spec(args).megatron_parallelism:
        return Parallel(world=world)
    return Parallel(world=world, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
                    etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size)


def stage_layers(args, shape: ModelShape, pp: int) -> list[int]:
    """Decoder layers per pipeline stage (Megatron's split, first/last stage flags honoured)."""
    ns = argparse.Namespace(
        pipeline_model_parallel_size=pp, num_layers=shape.num_layers,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
    )  # fmt: skip
    try:
        return pipeline_layer_split(ns)
    except SlimeArgumentError:  # uneven: parse_args reports it for megatron; spread the rest here
        base, extra = divmod(shape.num_layers, pp)
        return [base + (1 if s < extra else 0) for s in range(pp)]


def layer_activation_elements(shape: ModelShape, layer: int, tp: int = 1, sequence_parallel: bool = False,
                              etp: int = 1, padded_attention: bool = False) -> float:
    """Activation elements decoder layer `layer` keeps for its backward per token on one rank (module docstring);
    `padded_attention`: packed micro-batches attended right-padded (--attention-kernel cudnn), padding not counted."""
    h = shape.hidden_size
    replicated = (4 + max(0, shape.norms_per_layer - 2)) * h / (tp if sequence_parallel else 1)
    if shape.mla:
        heads = shape.num_heads / tp
        qk = (shape.qk_nope_head_dim or 0) + (shape.qk_rope_head_dim or 0)
        v = shape.v_head_dim or shape.head_dim
        latents = 2 * (shape.q_lora_rank or 0) + 2 * shape.kv_lora_rank + (shape.qk_rope_head_dim or 0)
        attention = latents + heads * ((shape.qk_nope_head_dim or 0) + v) + 2 * heads * qk + 2 * heads * v
    else:
        q = shape.num_heads * shape.head_dim / tp
        kv = max(1.0, shape.num_kv_heads / tp) * shape.head_dim
        if padded_attention:  # the padded query, key, value and output, the gathered output (+ the fused output)
            attention = 3 * q + 2 * kv + (2 * q + 2 * kv if shape.qk_norm else 0)
        else:
            attention = 3 * q + 3 * kv + (q if shape.qk_norm else 0)
    if shape.moe_layers[layer]:  # tokens are split over TP by sequence parallelism and gathered over expert-TP
        routed = shape.experts_per_token * (h + 3 * shape.moe_intermediate_size / etp)
        router = (shape.num_experts + shape.experts_per_token) / (tp if sequence_parallel else 1)  # scores, top-k
        mlp = routed * (etp / tp if sequence_parallel else 1) + router + 3 * shape.shared_expert_intermediate_size / tp
    else:
        mlp = 3 * shape.intermediate_size / tp
    return replicated + attention + mlp


def activation_bytes_per_token(shape: ModelShape, layers: range, tp: int, sequence_parallel: bool, act_bytes: int,
                               etp: int = 1, padded_attention: bool = False) -> float:
    """Mean bytes one of `layers` keeps for its backward per token of a micro-batch."""
    total = sum(layer_activation_elements(shape, i, tp, sequence_parallel, etp, padded_attention) for i in layers)
    return act_bytes * total / max(1, len(layers))


def megatron_bytes_per_param(args) -> tuple[int, int, int, str]:
    """(weights, gradients, optimizer) bytes per parameter of the megatron backend, and what the optimizer holds."""
    mixed = bool(args.bf16 or args.fp16)
    wb = 2 if mixed else 4
    gb = 4 if (args.accumulate_allreduce_grads_in_fp32 or not mixed) else 6  # 16-bit buffers + the step's fp32 copies
    if args.optimizer == "adam":
        ob, what = (12, "fp32 master + Adam m, v") if mixed else (8, "Adam m, v")
    elif args.sgd_momentum:
        ob, what = (8, "fp32 master + momentum") if mixed else (4, "momentum")
    else:
        ob, what = (4, "fp32 master") if mixed else (0, "nothing (SGD without momentum)")
    return wb, gb, ob, what


def state_bytes_per_param(args, with_ref: bool) -> int:
    """Weights + gradients + optimizer (+ a reference copy, + an OPD teacher of the student's size) per parameter,
    before any sharding."""
    frozen = int(with_ref) + int(holds_teacher(args))
    return training_memory_model(args).state_bytes_per_param(args, frozen)


def _megatron_state_bytes(args, frozen: int) -> int:
    wb, gb, ob, _ = megatron_bytes_per_param(args)
    if args.lora_rank:  # a frozen base: weights only (the adapters' share is left out of this lower bound)
        return wb + wb * frozen
    return wb + gb + ob + wb * frozen


def _fsdp_state_bytes(args, frozen: int) -> int:
    if args.lora_rank:  # a frozen base: fp32 weights only (the adapters' share is left out of this lower bound)
        return 4 + 4 * frozen
    return 16 + 4 * frozen  # fp32 weights, fp32 gradients, AdamW m, v (+ fp32 frozen copies)


def megatron_memory(args, shape: ModelShape, tokens: float | None, micro_batches: int | None,
                    with_ref: bool) -> tuple[Estimate, int]:
    """Estimate for the largest pipeline stage of the megatron backend, and that stage's index."""
    par = training_parallel(args)
    wb, gb, ob, opt_what = megatron_bytes_per_param(args)
    dist_opt = bool(args.use_distributed_optimizer)
    vocab = padded_vocab_size(argparse.Namespace(
        vocab_size=max(args.vocab_size or 0, shape.vocab_size), tensor_model_parallel_size=par.tp,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by))  # fmt: skip
    split = stage_layers(args, shape, par.pp)
    sp = bool(args.sequence_parallel) and par.tp > 1
    recompute = args.recompute_granularity
    best: tuple[Estimate, int] | None = None
    start = 0
    for stage, n_layers in enumerate(split):
        dense = expert = 0
        for layer in range(start, start + n_layers):
            d, e = layer_params(shape, layer)
            dense, expert = dense + d, expert + e
        start += n_layers
        first, last = stage == 0, stage == par.pp - 1
        if first:
            dense += embedding_params(shape, vocab)
        if last:
            dense += shape.hidden_size  # final norm
            if not shape.tie_word_embeddings or par.pp > 1:  # tied: the last stage keeps its own copy
                dense += embedding_params(shape, vocab)
        vision = shape.vision_params if first else 0  # the HF vision tower: whole on every TP rank of stage 0
        per_gpu = dense / par.tp + expert / (par.ep * par.etp) + vision
        est = Estimate()
        if expert:
            shard = (f"(non-expert {fmt_count(dense)} ÷ TP {par.tp} + experts {fmt_count(expert)} ÷ EP {par.ep} "
                     f"× ETP {par.etp})")
        else:
            shard = f"({fmt_count(dense)} ÷ TP {par.tp})"
        if vision:
            shard = f"{shard[:-1]} + vision tower {fmt_count(vision)}, not split)"
        est.items.append(Item("weights", per_gpu * wb, f"{fmt_count(per_gpu)} params {shard} × {wb} B"))
        if args.lora_rank:
            _megatron_lora_items(est, args, shape, par, n_layers, (wb, gb, ob, opt_what), dist_opt)
        else:
            copies = " (16-bit buffers 2 B + the optimizer step's fp32 copies 4 B)" if gb == 6 else ""
            est.items.append(Item("gradients", per_gpu * gb, f"{fmt_count(per_gpu)} × {gb} B{copies}"))
            if dist_opt:
                opt = dense / par.tp / (par.dp * par.cp) + expert / (par.ep * par.etp) / par.expert_dp
                how = f"{ob} B ({opt_what}) × params ÷ DP×CP {par.dp * par.cp}" + (
                    f" (experts ÷ expert-DP {par.expert_dp})" if expert else "") + " (the distributed optimizer)"
            else:
                opt = per_gpu
                how = f"{ob} B ({opt_what}) × {fmt_count(per_gpu)}, not sharded (--no-use-distributed-optimizer)"
            est.items.append(Item("optimizer", opt * ob, how))
        if with_ref:
            how = f"KL term: a frozen copy, {fmt_count(per_gpu)} × {wb} B"
            est.items.append(Item("reference model", per_gpu * wb, how))
        if holds_teacher(args):
            how = f"--opd-type megatron: the student's architecture, {fmt_count(per_gpu)} × {wb} B"
            est.items.append(Item("teacher model", per_gpu * wb, how))
        if tokens:
            in_flight = par.pp - stage if micro_batches is None else min(par.pp - stage, micro_batches)
            layers = range(start - n_layers, start)
            per_token = activation_bytes_per_token(shape, layers, par.tp, sp, wb, par.etp)
            if args.attention_kernel == "cudnn" and args.qkv_format == "thd" and par.cp == 1:
                # a micro-batch takes the padded route or keeps what flash does (one length: viewed; too uneven)
                per_token = max(per_token, activation_bytes_per_token(shape, layers, par.tp, sp, wb, par.etp, True))
            full = tokens * per_token
            formula = f"T × {per_token / 1024:,.1f} KiB (layer_activation_elements × {wb} B)"
            head = (f"T={tokens:,.0f} tokens, h={shape.hidden_size}, {n_layers} layers, "
                    f"{in_flight} micro-batch(es) in flight")
            if recompute == "full":
                group = max(1, args.recompute_num_layers or 1)
                kept = 2 * tokens * shape.hidden_size * wb / 2 / (par.tp if sp else 1)
                if args.recompute_method == "block":
                    ck = min(group, n_layers)
                    act = (ck * kept + (n_layers - ck) * full) * in_flight
                    how = f"{head}: {ck} recomputed layers × 2·T·h + {n_layers - ck} × {formula}"
                else:
                    act = math.ceil(n_layers / group) * kept * in_flight + group * full
                    how = (f"{head}: full recompute keeps 2·T·h per {group}-layer group, "
                           f"+ {group} layer(s) × {formula} while recomputing")
            else:
                act = n_layers * full * in_flight
                how = f"{head}: {formula} per layer"
            est.items.append(Item("activations", act, how))
            if last:
                logits = tokens * vocab / par.tp * 8
                how = (f"T × vocab {vocab} ÷ TP {par.tp} × 8 B (the logits, their gradient and fp32 chunks; "
                       "benchmarks/log_prob_memory.py)")
                est.items.append(Item("logits", logits, how))
        if best is None or est.total > best[0].total:
            best = (est, stage)
    est, stage = best
    if par.pp > 1:
        est.notes.append(f"pipeline stage {stage} of {par.pp} (layers per stage {split}), the largest")
    if recompute == "selective":
        est.notes.append("selective recompute only drops the attention-score term, which flash attention (assumed "
                         "here) never stores; --recompute-granularity full is what lowers activations")
    return est, stage


def _megatron_lora_items(est: Estimate, args, shape: ModelShape, par: Parallel, n_layers: int, sizes,
                         dist_opt: bool) -> None:
    """LoRA on Megatron: the frozen base has no gradients or optimizer state; the stage's adapters have both."""
    wb, gb, ob, opt_what = sizes
    per_layer, whole = megatron_adapter_params_per_layer(args, shape, par.tp)
    adapter = per_layer * n_layers
    head = f"LoRA r={args.lora_rank}: {fmt_count(adapter)} adapter params ({n_layers} layers × {fmt_count(per_layer)})"
    est.items.append(Item("LoRA adapters", adapter * wb, f"{head} × {wb} B"))
    est.items.append(Item("gradients", adapter * gb, f"{head} × {gb} B (the base is frozen: none)"))
    shards = par.dp * par.cp if dist_opt else 1
    est.items.append(Item("optimizer", adapter * ob / shards, f"{ob} B ({opt_what}) × the adapter params"
                          + (f" ÷ DP×CP {shards} (the distributed optimizer)" if dist_opt else "")
                          + "; the base has none"))


def holds_teacher(args) -> bool:
    """The trainer builds a frozen teacher next to the policy (on-policy distillation, docs/on_policy_distillation.md)."""
    return bool(getattr(args, "use_opd", False)) and getattr(args, "opd_type", None) == "megatron"


def fsdp_teacher_params(args, student: int) -> tuple[int, str]:
    """The fsdp trainer's teacher may be any architecture: its count from --opd-teacher-load's config.json when
    that is an HF folder, else (an fsdp checkpoint of the student) the student's."""
    path = getattr(args, "opd_teacher_load", None)
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            return count_params(load_model_shape(path)).total, f"{path}/config.json"
        except (OSError, ValueError, KeyError):
            pass
    return student, "the student's count"


def fsdp_memory(args, shape: ModelShape, tokens: float | None, with_ref: bool) -> Estimate:
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    cb = 2 if args.use_cuda else 4  # compute dtype: bf16 on CUDA, fp32 on CPU
    counts = count_params(shape)
    p = counts.total
    est = Estimate()
    est.items.append(Item("weights", 4 * p / world, f"{fmt_count(p)} params × 4 B (fp32 master) ÷ {world} ranks"))
    trained, what = p, ""
    if args.lora_rank:  # the base is frozen: gradients and AdamW state for the adapters only
        trained = fsdp_adapter_params(args, shape)
        what = f" LoRA r={args.lora_rank} adapter params (the frozen base has none)"
        est.items.append(Item("LoRA adapters", 4 * trained / world,
                              f"{fmt_count(trained)}{what} × 4 B ÷ {world} ranks"))
    est.items.append(Item("gradients", 4 * trained / world, f"{fmt_count(trained)}{what} × 4 B (fp32) ÷ {world} ranks"))
    est.items.append(Item("optimizer", 8 * trained / world,
                          f"{fmt_count(trained)}{what} × 8 B (AdamW m, v fp32) ÷ {world} ranks"))
    biggest_layer = max(sum(layer_params(shape, i)) for i in range(shape.num_layers))
    gathered = counts.embedding + counts.output + shape.hidden_size + 2 * biggest_layer
    est.items.append(Item("gathered params", gathered * cb,
                          f"embedding + output + 2 layers = {fmt_count(gathered)} × {cb} B (all-gathered for compute)"))
    if with_ref:
        how = f"KL term: fp32 shards, {fmt_count(p)} × 4 B ÷ {world}"
        est.items.append(Item("reference model", 4 * p / world, how))
    if holds_teacher(args):
        teacher, whose = fsdp_teacher_params(args, p)
        est.items.append(Item("teacher model", 4 * teacher / world,
                              f"--opd-type megatron: fp32 shards, {fmt_count(teacher)} params ({whose}) × 4 B ÷ {world}"))
    if tokens:
        act = shape.num_layers * tokens * shape.hidden_size * 34 * cb / 2
        how = (f"T={tokens:,.0f} tokens, h={shape.hidden_size}, {shape.num_layers} layers: 34·T·h bytes per layer"
               + (" × 2 (fp32)" if cb == 4 else "") + " (Korthikanti et al.; not counted on the HF layer)")
        est.items.append(Item("activations", act, how))
        est.items.append(Item("logits", tokens * shape.vocab_size * 8,
                              f"T × vocab {shape.vocab_size} × 8 B (logits, their response rows and "
                              "gradients; benchmarks/log_prob_memory.py)"))
    est.notes.append("fsdp: no activation recompute; the Megatron parallel and recompute flags do not apply")
    return est


def _megatron_estimate(args, shape: ModelShape, tokens: float | None, micro_batches: int | None,
                       with_ref: bool) -> Estimate:
    return megatron_memory(args, shape, tokens, micro_batches, with_ref)[0]


def _fsdp_estimate(args, shape: ModelShape, tokens: float | None, micro_batches: int | None,
                   with_ref: bool) -> Estimate:
    return fsdp_memory(args, shape, tokens, with_ref)  # every rank holds whole micro-batches of its own


@dataclass(frozen=True)
class TrainingMemoryModel:
    """A training backend's memory model in the planner (`TrainBackendSpec.memory_model` names it)."""

    # (args, frozen model copies) -> bytes per parameter of weights, gradients, optimizer and copies, unsharded
    state_bytes_per_param: Callable[[Any, int], int]
    # (args, shape, tokens per micro-batch, micro-batches per step, with a reference model) -> one rank's estimate
    estimate: Callable[..., Estimate]


TRAINING_MEMORY_MODELS = {
    "megatron": TrainingMemoryModel(_megatron_state_bytes, _megatron_estimate),
    "fsdp": TrainingMemoryModel(_fsdp_state_bytes, _fsdp_estimate),
}


def training_memory_model(args) -> TrainingMemoryModel:
    return TRAINING_MEMORY_MODELS[train_spec(args).memory_model]


def training_memory(args, shape: ModelShape, tokens: float | None, micro_batches: int | None,
                    with_ref: bool) -> Estimate:
    return training_memory_model(args).estimate(args, shape, tokens, micro_batches, with_ref)


# ---- engines -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotCache:
    """The hf engine's KV slots at their largest (see the module docstring)."""

    rows: int
    columns: int  # after the last growth
    previous: int  # before it (0: the first allocation was enough)
    bytes: float  # rows × columns × KV bytes per token
    peak: float  # rows × (columns + previous) × KV bytes per token: both buffers exist while it copies


def hf_slot_cache(rows_wanted: int, max_rows: int, prompt_tokens: int, sample_tokens: int,
                  kv_per_token: float) -> SlotCache:
    """The slots of `rows_wanted` running requests (at most `max_rows`) once samples of `sample_tokens` tokens
    (`prompt_tokens` of them the prompt) are generated: the first prefill allocates the prompt and one more column,
    the last decode step writes the sample's next-to-last token (its last is sampled, never fed back)."""
    rows = min(bucket_rows(max(1, rows_wanted)), bucket_rows(max_rows))
    columns, previous = grown_columns(0, prompt_tokens + 1), 0
    need = max(prompt_tokens + 1, sample_tokens - 1)
    while columns < need:
        previous, columns = columns, grown_columns(columns, columns + 1)
    return SlotCache(rows, columns, previous, rows * columns * kv_per_token, rows * (columns + previous) * kv_per_token)


@dataclass(frozen=True)
class EngineMemory:
    tp: int
    weight_bytes_per_param: int
    weights: float  # per GPU
    fraction: float | None  # mem_fraction_static (SGLang); None for the hf engine
    fraction_given: bool
    static: float | None  # fraction × GPU memory
    kv_budget: float | None
    kv_bytes_per_token: float
    kv_tokens: int | None  # per engine
    slots: SlotCache | None = None  # the hf engine on CUDA, when the sample length is known
    peak: float | None = None  # what the engine holds per GPU from its first full rollout until it releases memory


def mem_fraction_static(args) -> tuple[float, bool]:
    raw = args.sglang_args.get("mem_fraction_static")
    if raw is None:
        return DEFAULT_MEM_FRACTION_STATIC, False
    try:
        return float(raw), True
    except (TypeError, ValueError):
        raise SlimeArgumentError(
            f"--sglang-mem-fraction-static {raw!r}: expected a number in (0, 1), e.g. 0.7"
        ) from None


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_bytes: int) -> tuple[float, str]:
    if shape.mla:
        per = shape.num_layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * kv_bytes
        return per, (f"MLA: {shape.num_layers} layers × (kv_lora_rank {shape.kv_lora_rank} + rope "
                     f"{shape.qk_rope_head_dim}) × {kv_bytes} B")
    heads = max(1, shape.num_kv_heads // tp)
    per = 2 * shape.num_layers * heads * shape.head_dim * kv_bytes
    return per, (f"2 × {shape.num_layers} layers × {heads} kv heads per TP rank × head_dim {shape.head_dim} "
                 f"× {kv_bytes} B")


def engine_memory(args, shape: ModelShape, gpu_bytes: float | None, prompt_tokens: int | None = None,
                  sample_tokens: int | None = None) -> tuple[EngineMemory, str]:
    """Per-GPU memory of one engine, and how its KV bytes per token were computed. The hf engine's slots need the
    longest sample (`sample_tokens`, of which `prompt_tokens` the prompt; 0 when unknown)."""
    engine = engine_spec(args)
    tp = args.rollout_num_gpus_per_engine if engine.tensor_parallel else 1
    sglang_args = args.sglang_args
    if not args.use_cuda:
        wbytes = 4  # the hf engine runs float32 on CPU
    elif shape.quant_method == "fp8" or str(sglang_args.get("quantization", "")).startswith("fp8"):
        wbytes = 1
    else:
        wbytes = 2
    kv_b = 1 if str(sglang_args.get("kv_cache_dtype", "auto")).startswith("fp8") else (2 if args.use_cuda else 4)
    weights = count_params(shape).total * wbytes / tp
    per_token, how = kv_bytes_per_token(shape, tp, kv_b)
    if engine.kv_cache == "slots":
        if gpu_bytes is None or not sample_tokens:
            return EngineMemory(tp, wbytes, weights, None, False, None, None, per_token, None), how
        in_flight = args.over_sampling_batch_size * args.n_samples_per_prompt
        slots = hf_slot_cache(min(in_flight, args.sglang_server_concurrency), args.sglang_server_concurrency,
                              prompt_tokens or 0, sample_tokens, per_token)
        return EngineMemory(tp, wbytes, weights, None, False, None, None, per_token, None, slots,
                            weights + slots.peak), how
    if gpu_bytes is None:
        return EngineMemory(tp, wbytes, weights, None, False, None, None, per_token, None), how
    fraction, given = mem_fraction_static(args)
    static = fraction * gpu_bytes
    budget = static - weights
    tokens = int(budget // per_token) if budget > 0 else 0
    return EngineMemory(tp, wbytes, weights, fraction, given, static, budget, per_token, tokens, None, static), how
