"""What configuration, planning and the runtime need to know about each training backend and rollout engine: one
record per backend, pure data (no backend code is imported here, so the parser, the `--dry-run` planner and the
runtime layers can all read it).

The code of a backend lives elsewhere (`slime/ray/actor_group.py`'s `TRAIN_BACKENDS`, `slime/ray/rollout.py`'s
`ENGINE_CLASSES`); a new backend adds its class there and its record here. Callers ask the record a question
(`train_spec(args).megatron_parallelism`) instead of comparing `args.train_backend` with a name.

Simplified: the records hold the facts this implementation branches on today, not a general capability model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainBackendSpec:
    """A training backend (`--train-backend`)."""

    name: str
    # The architecture comes from Megatron-LM's flags (MODEL_ARGS): they are required at start, checked against
    # --hf-checkpoint's config.json (a mismatch is an error) and validated; otherwise the model is read from
    # --hf-checkpoint and the Megatron flags are unused (warned).
    model_from_megatron_flags: bool
    # Megatron's TP / PP / CP / EP flags shape the ranks (data-parallel size, memory per rank); otherwise every
    # rank is a data-parallel rank (FSDP).
    megatron_parallelism: bool
    # The checkpoint format of --load / --save iterations (slime/utils/checkpoint_layout.py): "torch_dist" or "hf".
    checkpoint_format: str
    # A PPO critic implementation exists (its checkpoints under --save/critic, slime/utils/checkpoint_layout.py).
    has_critic: bool
    # The --dry-run planner's memory model of one training rank (slime/config/plan/memory.py).
    memory_model: str
    # Trains in bf16 on GPU unless --fp16 (slime's Megatron scripts pass neither flag).
    bf16_by_default_on_gpu: bool
    # Runs only on GPUs (a CPU run is warned: megatron-core runs without CUDA only through the test shim).
    expects_cuda: bool
    # Trains LoRA adapters on a frozen base (--lora-rank > 0; docs/lora.md).
    trains_lora: bool = False
    # The --optimizer choices it steps (the others are refused at start).
    optimizers: tuple[str, ...] = ("adam", "sgd")


@dataclass(frozen=True)
class EngineSpec:
    """A rollout engine (`--rollout-backend`), or the external engines of --rollout-external-engine-addrs."""

    name: str
    # Launched by the RolloutManager (external engines are only registered with the router).
    launched: bool
    # Starts only with CUDA (or through SLIME_SGLANG_LAUNCHER, for sglang).
    needs_cuda: bool
    # An engine shards the model over its --rollout-num-gpus-per-engine devices (SGLang's tensor parallelism:
    # the heads must divide); otherwise one device holds the whole model.
    tensor_parallel: bool
    # An engine wider than a node spans whole nodes (one process per node, slime/utils/placement.py).
    spans_nodes: bool
    # Its servers take the forwarded --sglang-<field> flags, typed against the installed SGLang.
    takes_sglang_server_args: bool
    # KV cache memory (the planner's model): "static_pool" (a fraction of the GPU reserved at start, SGLang's
    # mem_fraction_static), "slots" (the hf engine's KV slots, grown as requests arrive) or None (not launched).
    kv_cache: str | None
    # Sampling settings the engine does not implement: (field, value that means "off").
    unsupported_sampling: tuple[tuple[str, float], ...] = ()
    # Serves a LoRA adapter pushed as tensors (/load_lora_adapter_from_tensors) to the requests naming it in
    # lora_path (docs/lora.md).
    serves_lora: bool = False
    # Is sent the rows' images (--multimodal-keys) as /generate's image_data by the rollout, and serves them.
    takes_images: bool = False
    # Takes input_ids that hold the images' expanded tokens with image_data: a continued sample with images goes as
    # ids with one image token per image, which every engine expands; when the policy sampled image tokens itself
    # the ids must go expanded, and SGLang would expand them a second time (generation.image_request).
    takes_expanded_image_ids: bool = False


TRAIN_BACKEND_SPECS: dict[str, TrainBackendSpec] = {
    "megatron": TrainBackendSpec(
        name="megatron", model_from_megatron_flags=True, megatron_parallelism=True, checkpoint_format="torch_dist",
        has_critic=False, memory_model="megatron", bf16_by_default_on_gpu=True, expects_cuda=True,
        trains_lora=True,
    ),
    "fsdp": TrainBackendSpec(
        name="fsdp", model_from_megatron_flags=False, megatron_parallelism=False, checkpoint_format="hf",
        has_critic=True, memory_model="fsdp", bf16_by_default_on_gpu=False, expects_cuda=False,
        trains_lora=True, optimizers=("adam",),
    ),
}  # fmt: skip

ENGINE_SPECS: dict[str, EngineSpec] = {
    "sglang": EngineSpec(
        name="sglang", launched=True, needs_cuda=True, tensor_parallel=True, spans_nodes=True,
        takes_sglang_server_args=True, kv_cache="static_pool", serves_lora=True, takes_images=True,
    ),
    "hf": EngineSpec(
        name="hf", launched=True, needs_cuda=False, tensor_parallel=False, spans_nodes=False,
        takes_sglang_server_args=False, kv_cache="slots",
        unsupported_sampling=(("min_new_tokens", 0), ("repetition_penalty", 1.0)), serves_lora=True,
        takes_images=True, takes_expanded_image_ids=True,
    ),
}  # fmt: skip

# Running servers speaking SGLang's HTTP API: nothing is launched, so nothing about them is planned or refused here.
EXTERNAL_ENGINES = EngineSpec(
    name="external", launched=False, needs_cuda=False, tensor_parallel=False, spans_nodes=False,
    takes_sglang_server_args=False, kv_cache=None,
)  # fmt: skip


def default_train_backend(use_cuda: bool, has_model_args: bool) -> str:
    """--train-backend when not given: megatron on GPU with MODEL_ARGS (it needs the architecture flags), fsdp
    otherwise (the model then comes from --hf-checkpoint)."""
    return "megatron" if use_cuda and has_model_args else "fsdp"


def default_rollout_backend(use_cuda: bool) -> str:
    """--rollout-backend when not given: SGLang with CUDA, the built-in hf engine without."""
    return "sglang" if use_cuda else "hf"


def train_spec(args) -> TrainBackendSpec:
    """The record of `args.train_backend` (resolved by validation)."""
    return TRAIN_BACKEND_SPECS[args.train_backend]


def engine_spec(args) -> EngineSpec:
    """The record of the engines this run talks to: the external ones when --rollout-external-engine-addrs is
    given, else `args.rollout_backend`'s (its default when validation has not resolved it yet)."""
    if args.rollout_external_engine_addrs is not None:
        return EXTERNAL_ENGINES
    return ENGINE_SPECS[args.rollout_backend or default_rollout_backend(args.use_cuda)]
