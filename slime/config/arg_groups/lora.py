"""LoRA: train low-rank adapters on a frozen base model and push only the adapters to the engines.

The flags are those of the slime fork radixark/miles (`--lora-rank` 0 = off, `--lora-alpha`, `--lora-dropout`,
`--target-modules`, `--exclude-modules`, `--lora-adapter-path`), so its launch scripts' LoRA arguments parse here.
Built: the fsdp and Megatron trainers with the `hf` engine, colocated or not (docs/lora.md). Its other LoRA flags parse with its defaults and are
refused (or warned about) when set: split-QKV `canonical_lora`, adapters trained but not served
(`--lora-train-only`), several adapters in one job (`--multi-lora-*`).
"""

from __future__ import annotations

import argparse
import logging

from slime.backends.megatron_utils.lora import megatron_targets
from slime.config.arg_groups._common import fail
from slime.utils.backend_specs import ENGINE_SPECS, TRAIN_BACKEND_SPECS, engine_spec, train_spec
from slime.utils.lora_adapter import ALL_LINEAR, module_names

logger = logging.getLogger(__name__)

# Flags of the fork that are not built here: dest -> (argparse settings, the value that is what the run does
# anyway, "refuse" | "warn", why, what to do instead).
_NOT_BUILT = {
    "lora_type": ({"type": str, "choices": ["lora", "canonical_lora"], "default": "lora"}, "lora", "refuse",
                  "canonical_lora (split Q/K/V adapters on Megatron's fused QKV) is not built; the Megatron trainer "
                  "gives each fused layer one adapter, the fsdp trainer adapts the HF model's own q_proj/k_proj/v_proj",
                  "drop it (the default lora)"),
    "lora_sync_from_tensor": ({"action": "store_true"}, False, "warn",
                              "the adapter always travels as tensors here", "drop it"),
    "lora_train_only": ({"action": "store_true"}, False, "refuse",
                        "training adapters while the engines keep generating with the base model is not built",
                        "drop it (the engines serve the trained adapter)"),
    "multi_lora_n_adapters": ({"type": int, "default": 0}, 0, "refuse",
                              "several adapters trained in one job (multi-LoRA) is not built",
                              "train one adapter per job"),
    "multi_lora_adapters": ({"nargs": 2, "action": "append", "type": str, "default": []}, [], "refuse",
                            "several adapters trained in one job (multi-LoRA) is not built",
                            "train one adapter per job"),
}
_OPTION = {"multi_lora_adapters": "--multi-lora-adapter"}


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA", "Low-rank adapters on a frozen base model (the slime fork radixark/miles's "
                                  "flags; fsdp and Megatron trainers, hf engine: docs/lora.md).")  # fmt: skip
    g.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA rank r; 0 (the default) trains the full model. With r > 0 only the adapters "
                   "(A: r x in, B: out x r) of the --target-modules train, and each weight push sends only them.")
    g.add_argument("--lora-alpha", type=int, default=16,
                   help="LoRA scaling: a layer computes W x + (alpha / r) B A x.")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="Dropout on the adapter's input; only 0 is accepted (every forward runs without dropout, "
                   "so the trainer's log-probs agree with the engine's).")
    g.add_argument("--target-modules", type=str, default=None,
                   help="Which linear layers get adapters: all-linear (every nn.Linear of the decoder, not the LM "
                   "head) or comma-separated module names (the last part of the HF name, e.g. "
                   "q_proj,k_proj,v_proj,o_proj). Required with --lora-rank > 0. On the Megatron trainer q/k/v and "
                   "gate/up are one fused layer each, adapted whole: name all of a group or none.")
    g.add_argument("--exclude-modules", type=str, default=None,
                   help="Comma-separated module names taken out of --target-modules.")
    g.add_argument("--lora-adapter-path", type=str, default=None,
                   help="Start from this PEFT adapter folder (adapter_config.json, adapter_model.safetensors) "
                   "instead of a zero adapter.")
    g.add_argument("--lora-base-cpu-backup", action="store_true",
                   help="miles: engines that release their memory (--colocate / --offload-rollout) keep a host copy "
                   "of the frozen base weights and restore it on resume, so a push sends only the adapter. Here "
                   "such a LoRA run always does this (SGLang: --enable-weights-cpu-backup; hf engine: one host copy "
                   "taken once), so the flag changes nothing; without --offload-rollout the engines keep their "
                   "weights and it has no effect (warned).")
    for dest, (kwargs, _, kind, why, _) in _NOT_BUILT.items():
        what = "refused when set" if kind == "refuse" else "warned about when set (not acted on)"
        g.add_argument(_OPTION.get(dest, "--" + dest.replace("_", "-")), dest=dest, help=f"miles: {what}: {why}.",
                       **kwargs)


def validate_lora(args: argparse.Namespace) -> None:
    for dest, (_, default, kind, why, instead) in _NOT_BUILT.items():
        value = getattr(args, dest)
        if value == default:
            continue
        shown = _OPTION.get(dest, "--" + dest.replace("_", "-"))
        if kind == "warn":
            logger.warning("%s: not acted on here: %s; %s.", shown, why, instead)
        else:
            fail(f"{shown} {value}: not supported here: {why}; {instead}.")
    if args.lora_rank < 0:
        fail(f"--lora-rank {args.lora_rank}: must be 0 (no LoRA) or a positive rank.")
    if args.lora_rank == 0:
        given = [f for f, v in (("--target-modules", args.target_modules), ("--exclude-modules", args.exclude_modules),
                                ("--lora-adapter-path", args.lora_adapter_path)) if v]  # fmt: skip
        if given:
            logger.warning("%s: LoRA is off (--lora-rank 0), so they have no effect; pass --lora-rank R to train "
                           "adapters.", ", ".join(given))
        return
    if not train_spec(args).trains_lora:
        trainers = [name for name, spec in TRAIN_BACKEND_SPECS.items() if spec.trains_lora]
        fail(f"--lora-rank {args.lora_rank}: LoRA is not built for --train-backend {args.train_backend}; pass "
             f"--train-backend {' or '.join(trainers)}.")
    if not module_names(args.target_modules):
        fail(f"--lora-rank {args.lora_rank} needs --target-modules: all-linear or comma-separated module names "
             "(e.g. q_proj,k_proj,v_proj,o_proj).")
    targets = module_names(args.target_modules)
    if ALL_LINEAR in targets and len(targets) > 1:
        fail(f"--target-modules {args.target_modules}: all-linear stands alone; give it or a list of names.")
    if train_spec(args).model_from_megatron_flags:  # the adapters go on megatron-core's modules
        _validate_megatron_lora(args)
    if args.lora_alpha <= 0:
        fail(f"--lora-alpha {args.lora_alpha}: must be positive (the adapter is scaled by alpha / rank).")
    if args.lora_dropout != 0.0:
        fail(f"--lora-dropout {args.lora_dropout}: not supported here: the trainers run every forward without "
             "dropout so that its log-probs agree with the engine's; pass --lora-dropout 0.")
    if args.only_train_params_name_list or args.freeze_params_name_list:
        fail(f"--lora-rank {args.lora_rank} with --only-train-params-name-list / --freeze-params-name-list: with "
             "LoRA only the adapters train and the base is frozen; drop the name lists.")
    if args.update_weight_transport == "disk" or args.update_weight_mode == "delta":
        fail(f"--lora-rank {args.lora_rank} with --update-weight-transport {args.update_weight_transport} / "
             f"--update-weight-mode {args.update_weight_mode}: the adapter is pushed as tensors "
             "(/load_lora_adapter_from_tensors); drop the disk / delta flags.")
    if args.check_weight_update_equal:
        fail(f"--lora-rank {args.lora_rank} with --check-weight-update-equal: that check overwrites every engine "
             "tensor and expects one push to restore them all, while a LoRA push sends only the adapter; drop it.")
    if args.lora_base_cpu_backup and not args.offload_rollout:
        logger.warning("--lora-base-cpu-backup: no effect without --offload-rollout (on with --colocate): the engines "
                       "never release their weights; drop it.")
    if not engine_spec(args).serves_lora:
        engines = [name for name, spec in ENGINE_SPECS.items() if spec.serves_lora]
        fail(f"--lora-rank {args.lora_rank}: serving the adapter is not built for {engine_spec(args).name} engines; "
             f"pass --rollout-backend {' or '.join(engines)}.")


def _validate_megatron_lora(args: argparse.Namespace) -> None:
    """LoRA on the Megatron trainer: the decoder's dense linears (megatron_utils/lora.py); fused q/k/v and gate/up
    adapted whole."""
    try:
        megatron_targets(args.target_modules, args.exclude_modules)
    except ValueError as e:
        fail(str(e) + ".")
    for flag, on in (("--num-experts", args.num_experts), ("--multi-latent-attention", args.multi_latent_attention),
                     ("--sequence-parallel", args.sequence_parallel)):
        if on:
            fail(f"--lora-rank {args.lora_rank} with {flag} {on} on the Megatron trainer: adapters on MoE experts, "
                 "multi-latent attention and sequence-parallel layers are not built; drop it, or train with "
                 "--train-backend fsdp.")
