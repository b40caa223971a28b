"""Megatron-LM's own flags: model architecture, parallelism, recompute, checkpoint format, fusions.

megatron-core ships no argument parser (Megatron-LM's `megatron.training` is not on the package
registries), so the flags slime users pass (`${MODEL_ARGS[@]}` from scripts/models, the parallel sizes of
their run scripts) are defined here with Megatron-LM's names, defaults and meanings. They are parsed into
typed attributes (`args.num_layers`, `args.tensor_model_parallel_size`, ...); the raw tokens are kept in
`args.megatron_args` as well. `slime.backends.megatron_utils.args` maps them onto megatron-core's configs.

Training flags both backends read (`--lr`, `--seed`, `--clip-grad`, `--bf16`, `--fp16`, `--save`, `--load`,
`--micro-batch-size`, `--global-batch-size`, `--calculate-per-token-loss`, `--distributed-timeout-minutes`,
...) live in their own areas and are not repeated here.

Simplifications: only the Megatron-LM flags an RL run uses are defined (no data-loader, tokenizer,
logging or pretraining-schedule flags); an unknown flag is an error with a "did you mean" hint, so a
missing one shows up at once instead of being silently ignored. Two flags are slime's additions to
Megatron-LM for GLM-4 (`--post-self-attn-layernorm`, `--post-mlp-layernorm`), as in slime.
`--moe-layer-freq` accepts an int or Megatron-LM's list expression (`"([0]*3+[1]*58)"`), evaluated without
`eval`.
"""

from __future__ import annotations

import argparse
import ast
import logging
from collections.abc import Callable

from slime.backends.megatron_utils import model as megatron_model
from slime.backends.megatron_utils.args import (
    divisors,
    moe_layer_pattern,
    padded_vocab_size,
    pipeline_layer_split,
    query_groups,
    resolve_training_options,
)
from slime.backends.megatron_utils.arguments import validate_allgather_cp
from slime.backends.megatron_utils.config_check import is_hf_folder, load_hf_config
from slime.backends.megatron_utils.plugins import check_spec
from slime.backends.megatron_utils.vision_language import check_deepstack_layout, check_vision_tower
from slime.config.arg_groups._common import fail
from slime.utils.backend_specs import train_spec
from slime.utils.errors import SlimeArgumentError
from slime.utils.megatron_roles import ROLES, megatron_role_overrides, role_args

logger = logging.getLogger(__name__)

# Every dest this module defines; the assembler copies these flags' tokens into args.megatron_args.
MEGATRON_DESTS: set[str] = set()


def _int_list_expr(text: str) -> int | list[int]:
    """`4` -> 4; `[1,0,1]` or `([0]*3+[1]*58)` -> the list. Only ints, lists, `*` and `+` are allowed."""
    try:
        return int(text)
    except ValueError:
        pass

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = value(node.left), value(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an int or a list expression such as '([0]*3+[1]*58)'"
        ) from e
    if not isinstance(result, list) or not all(isinstance(x, int) for x in result):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a flat list of 0/1 per layer")
    return result


class _Group:
    """An argument group that records every dest it defines in MEGATRON_DESTS."""

    def __init__(self, group):
        self._group = group

    def add_argument(self, *names, **kwargs):
        action = self._group.add_argument(*names, **kwargs)
        MEGATRON_DESTS.add(action.dest)
        return action


def _add_architecture(parser) -> None:
    g = _Group(parser.add_argument_group("megatron architecture", "Megatron-LM model flags (scripts/models/*.sh)."))
    g.add_argument("--num-layers", type=int, default=None, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Hidden size.")
    g.add_argument(
        "--ffn-hidden-size", type=int, default=None,
        help="MLP hidden size (default 4×hidden, or 2/3 of that rounded down to 64 with --swiglu).",
    )  # fmt: skip
    g.add_argument("--num-attention-heads", type=int, default=None, help="Attention (query) heads.")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1, help="Key/value heads with --group-query-attention.")
    g.add_argument("--kv-channels", type=int, default=None, help="Head dim (default hidden / heads).")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU).")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of every norm.")
    g.add_argument("--apply-layernorm-1p", action="store_true", help="Norm weights stored as (w - 1).")
    g.add_argument(
        "--position-embedding-type", choices=["learned_absolute", "rope", "mrope", "relative", "none"],
        default="learned_absolute",
    )  # fmt: skip
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Deprecated alias of --position-embedding-type rope.",
    )
    g.add_argument("--mrope-section", type=int, nargs="+", default=None,
                   help="Multimodal RoPE (--position-embedding-type mrope): the rotary frequencies given to the "
                        "temporal, height and width position ids, in pairs (sums to kv-channels / 2), as the HF "
                        "config's rope_parameters / rope_scaling mrope_section.")
    g.add_argument("--rotary-base", type=float, default=10000, help="RoPE theta.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of the head dim RoPE rotates.")
    g.add_argument("--rotary-interleaved", action="store_true", help="Rotate interleaved pairs, not halves.")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 RoPE frequency scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Factor of --use-rope-scaling.")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", help="Unfused RoPE kernel.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size before padding.")
    g.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128,
        help="Pad the vocabulary to a multiple of this × TP (padding is stripped on HF export).",
    )  # fmt: skip
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", help="Separate output layer.")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", help="No linear biases.")
    g.add_argument("--add-qkv-bias", action="store_true", help="Bias on the QKV projection only.")
    g.add_argument("--qk-layernorm", action="store_true", help="Norm on queries and keys (per head).")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None, help="Training sequence length.")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Megatron-LM's default; RL runs pass 0.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Megatron-LM's default; RL runs pass 0.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--post-self-attn-layernorm", action="store_true", help="slime: GLM-4 norm after attention.")
    g.add_argument("--post-mlp-layernorm", action="store_true", help="slime: GLM-4 norm after the MLP.")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="Multi-token-prediction layers (not trained).")

    m = _Group(parser.add_argument_group("megatron moe", "Mixture-of-experts flags."))
    m.add_argument("--num-experts", type=int, default=None, help="Routed experts per MoE layer.")
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Hidden size of each routed expert.")
    m.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="Total shared-expert size.")
    m.add_argument("--moe-shared-expert-overlap", action="store_true")
    m.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    m.add_argument(
        "--moe-layer-freq", type=_int_list_expr, default=1,
        help="Every Nth layer is MoE, or a per-layer 0/1 list expression such as '([0]*3+[1]*58)'.",
    )  # fmt: skip
    m.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    m.add_argument("--moe-router-pre-softmax", action="store_true")
    m.add_argument("--moe-router-enable-expert-bias", action="store_true", help="Aux-loss-free expert bias.")
    m.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    m.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    m.add_argument("--moe-router-num-groups", type=int, default=None, help="Expert groups (device-limited routing).")
    m.add_argument("--moe-router-group-topk", type=int, default=None, help="Groups picked per token.")
    m.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    m.add_argument(
        "--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        default="aux_loss",
    )  # fmt: skip
    m.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    m.add_argument("--moe-z-loss-coeff", type=float, default=None)
    m.add_argument("--moe-grouped-gemm", action="store_true", help="Grouped GEMM experts (TEGroupedMLP names).")
    m.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    m.add_argument("--moe-permute-fusion", action="store_true")
    m.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    m.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    m.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")

    a = _Group(parser.add_argument_group("megatron mla", "Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight)."))
    a.add_argument("--multi-latent-attention", action="store_true")
    a.add_argument("--q-lora-rank", type=int, default=None, help="Query low-rank size (none: plain q projection).")
    a.add_argument("--kv-lora-rank", type=int, default=32)
    a.add_argument("--qk-head-dim", type=int, default=128, help="Query/key head dim without the RoPE part.")
    a.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="RoPE part of the query/key head dim.")
    a.add_argument("--v-head-dim", type=int, default=128)
    a.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN factor.")
    a.add_argument("--original-max-position-embeddings", type=int, default=None, help="YaRN original length.")
    a.add_argument("--beta-fast", type=float, default=32.0)
    a.add_argument("--beta-slow", type=float, default=1.0)
    a.add_argument("--mscale", type=float, default=1.0)
    a.add_argument("--mscale-all-dim", type=float, default=0.0)
    a.add_argument("--rope-type", choices=["rope", "yarn"], default=None, help="MLA RoPE (default yarn).")


def _add_parallel(parser) -> None:
    g = _Group(parser.add_argument_group("megatron parallelism"))
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Split each packed micro-batch over this many ranks in slime's zigzag layout (megatron backend, "
                   "--qkv-format thd, slime's attention: --transformer-impl local where TransformerEngine is installed).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="Default: the TP size.")
    g.add_argument("--sequence-parallel", action="store_true", help="Shard norms/dropout along the sequence (TP > 1).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument(
        "--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
        help="Shard the optimizer state (fp32 main parameters, Adam's moments) over the data-parallel ranks "
        "(megatron-core's DistributedOptimizer). On by default for the megatron trainer, as slime turns it on for "
        "every run (its scripts do not pass it), except with --optimizer sgd (megatron-core's distributed optimizer "
        "steps Adam or its hybrid host optimizer only; asked for with sgd and without --optimizer-cpu-offload it "
        "is refused at start); --no-use-distributed-optimizer (not slime's) keeps a whole copy on every rank.",
    )
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Gradient buffers (main_grad) in fp32: accumulated over micro-batches and reduced over "
                        "data-parallel ranks in fp32. On with --bf16 unless --grad-reduce-in-bf16 (Megatron-LM's "
                        "rule).")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: gradient buffers in bf16, accumulated and reduced in bf16 (megatron-core DDP: "
                        "not in fp32); saves 2 B per parameter between steps, but the optimizer step then makes fp32 "
                        "copies of them (4 B per parameter at its peak).")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="fp16 dynamic loss scale start.")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale", type=float, default=None, help="Static fp16 loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    # Megatron-LM's optimizer offload, schedule and checks (their effect: slime/backends/megatron_utils/args.py)
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Keep the optimizer state and its update on the host (megatron-core's HybridDeviceOptimizer; "
                   "needs --use-precision-aware-optimizer).")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="Share of the optimizer state --optimizer-cpu-offload keeps on the host.")
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true",
                   help="--optimizer-cpu-offload with torch's optimizer on the GPU share too.")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="Overlap --optimizer-cpu-offload's device<->host copies with the host update.")
    g.add_argument("--no-pin-cpu-grads", dest="pin_cpu_grads", action="store_false",
                   help="--optimizer-cpu-offload: pageable (not pinned) host gradients.")
    g.add_argument("--no-pin-cpu-params", dest="pin_cpu_params", action="store_false",
                   help="--optimizer-cpu-offload: pageable (not pinned) host parameters.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="Do not stop at a NaN/Inf loss or local gradient norm.")


def _add_runtime(parser) -> None:
    g = _Group(parser.add_argument_group("megatron recompute, checkpoint, kernels"))
    g.add_argument("--recompute-activations", action="store_true", help="Alias of --recompute-granularity selective.")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None)
    g.add_argument(
        "--ckpt-format", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"], default="torch_dist",
        help="Megatron checkpoint format; the megatron backend here reads and writes torch_dist only.",
    )
    g.add_argument("--no-save-rng", action="store_true",
                   help="Megatron-LM: do not save the RNG state. Checkpoints here hold none (warned).")
    g.add_argument("--finetune", action="store_true", help="Load weights only; reset the iteration to 0.")
    g.add_argument(
        "--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], default="auto",
        help="megatron-core attention backend (local when TransformerEngine is missing).",
    )  # fmt: skip
    g.add_argument(
        "--transformer-impl", choices=["local", "transformer_engine"], default="transformer_engine",
        help="Layer implementation: TransformerEngine's layers when it is installed (else the local spec, warned), "
        "or megatron-core's local layers.",
    )
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="Write each weight gradient in the parameters' dtype and add it into the fp32 main_grad "
                        "afterwards, instead of accumulating it there inside the weight-gradient GEMM (on by default; "
                        "without TransformerEngine or apex slime's own accumulator does it on CUDA: "
                        "megatron_utils/wgrad_fusion.py).")
    g.add_argument("--no-persist-layer-norm", dest="persist_layer_norm", action="store_false")
    g.add_argument("--use-flash-attn", action="store_true", help="Deprecated alias of --attention-backend flash.")
    g.add_argument(
        "--qkv-format", choices=["thd", "bshd"], default="thd",
        help="Micro-batch layout of the megatron backend: thd packs a micro-batch's samples into one row, each "
             "attending only to itself (no padding); bshd right-pads them into [batch, longest] rows.",
    )  # fmt: skip
    g.add_argument(
        "--spec", type=str, nargs="*", default=None,
        help="MODULE FUNCTION of a layer spec (or of fn(args, config, vp_stage) returning one, or a model provider) "
        "instead of the built-in one; slime's slime_plugins.models.glm4 get_glm_spec is the built-in spec here.",
    )
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Deterministic kernels and all-reduce order on every training rank (NCCL_ALGO default Ring).")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="Megatron-LM's deprecated switch: no learned absolute position table (allowed with RoPE).")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="Megatron-LM's padded vocabulary (derived: --vocab-size up to a multiple of "
                   "--make-vocab-size-divisible-by × TP); a different value is refused.")
    g.add_argument("--allgather-cp", action="store_true",
                   help="slime: all-gather context parallelism for DSA attention models; refused with "
                   "--context-parallel-size > 1 (no DSA model is built here), no effect without.")
    g.add_argument("--megatron-config-path", type=str, default=None,
                   help="slime: YAML of per-role (actor / critic) overrides, `megatron: [{role: critic, "
                   "overrides: {lr: 1e-5}}]`: each training group (the actor with its reference model, the PPO "
                   "critic) is built from a copy of the args with its role's overrides (num_nodes / "
                   "num_gpus_per_node are ignored: GPU counts follow the command line).")


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    _add_architecture(parser)
    _add_parallel(parser)
    _add_runtime(parser)


# ---- validation ----------------------------------------------------------------------------------------


def derive_megatron(args: argparse.Namespace) -> None:
    """Fill Megatron-LM's derived defaults (aliases, default sizes) in place; never fails."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.use_flash_attn and args.attention_backend == "auto":
        args.attention_backend = "flash"
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.hidden_size and args.num_attention_heads and args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.hidden_size and args.ffn_hidden_size is None:
        # Megatron-LM: 4h, or with SwiGLU 2/3 of 4h rounded down to a multiple of 64.
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.num_experts and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.bf16 and not args.grad_reduce_in_bf16:
        # Megatron-LM: bf16 training accumulates and all-reduces gradients in fp32 (fp32 main_grad buffers), which
        # the optimizer step also reads without copying them
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        # Megatron-LM turns it off silently; we say so.
        logger.warning("--sequence-parallel has no effect with --tensor-model-parallel-size 1; turning it off.")
        args.sequence_parallel = False


def check_slime_megatron_flags(args: argparse.Namespace) -> None:
    """--padded-vocab-size, --allgather-cp and --megatron-config-path (its file's layout; each role's copy is
    checked by `check_megatron_roles`): what slime does with them, and what is refused here."""
    if args.padded_vocab_size is not None:
        derived = padded_vocab_size(args) if args.vocab_size else None
        if derived != args.padded_vocab_size:
            fail(f"--padded-vocab-size {args.padded_vocab_size}: the vocabulary here is padded to a multiple of "
                 f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} × TP "
                 f"{args.tensor_model_parallel_size}" + (f" (= {derived} for --vocab-size {args.vocab_size})"
                                                         if derived else " of --vocab-size, which is not given")
                 + "; drop --padded-vocab-size and set --vocab-size / --make-vocab-size-divisible-by instead.")
    if args.allgather_cp:
        try:
            validate_allgather_cp(args, load_hf_config(args.hf_checkpoint) if is_hf_folder(args.hf_checkpoint) else None)
        except ValueError as e:
            fail(str(e))
        if args.context_parallel_size == 1:
            logger.warning("--allgather-cp has no effect with --context-parallel-size 1.")
    if args.megatron_config_path is not None:
        try:
            for role in ROLES:
                megatron_role_overrides(args.megatron_config_path, role)
        except (OSError, ValueError) as e:
            fail(str(e))


def trained_roles(args: argparse.Namespace) -> list[str]:
    """The roles whose training groups the run builds."""
    if args.debug_rollout_only:
        return []
    return ["actor", "critic"] if args.use_critic else ["actor"]


def check_megatron_roles(args: argparse.Namespace, check_role: Callable[[argparse.Namespace], None]) -> None:
    """--megatron-config-path: each trained role's copy of the args (slime.utils.megatron_roles.role_args) passes
    `check_role` (the Megatron layout and batch checks the base args passed), so that a role's override that breaks
    the layout fails here, before Ray starts, naming the file and the role. A role that is not trained (the critic
    without a critic estimator) is only read."""
    path = args.megatron_config_path
    if path is None:
        return
    for role in trained_roles(args):
        overrides = megatron_role_overrides(path, role)
        if not overrides:
            continue
        copy = role_args(args, role)
        copy.megatron_config_path = None  # the copy is checked as a command line of its own
        try:
            check_role(copy)
        except SlimeArgumentError as e:
            fail(f"--megatron-config-path {path}: with the {role}'s overrides {overrides}: {e}")
    if not args.use_critic and megatron_role_overrides(path, "critic"):
        logger.warning("--megatron-config-path %s: the critic's overrides are not used: --advantage-estimator %s "
                       "trains no critic.", path, args.advantage_estimator)


def validate_megatron(args: argparse.Namespace) -> None:
    """Megatron-LM's derived defaults, then (for --train-backend megatron) the parallel-layout checks."""
    derive_megatron(args)
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size"):  # fmt: skip
        value = getattr(args, dest)
        if value < 1:
            fail(f"--{dest.replace('_', '-')} {value}: must be >= 1.")
    pattern = moe_layer_pattern(args)
    if pattern is not None and len(pattern) != args.num_layers:
        fail(
            f"--moe-layer-freq gives {len(pattern)} layer(s) but --num-layers is {args.num_layers}; "
            "the list needs one 0/1 per layer."
        )
    if args.group_query_attention and args.num_attention_heads and args.num_attention_heads % args.num_query_groups:
        fail(
            f"--num-attention-heads {args.num_attention_heads} is not a multiple of --num-query-groups "
            f"{args.num_query_groups}; each key/value head must serve a whole number of query heads."
        )
    if args.recompute_method is not None and args.recompute_granularity != "full":
        fail(f"--recompute-method {args.recompute_method} needs --recompute-granularity full.")
    if args.recompute_granularity == "full" and args.recompute_method and args.recompute_num_layers is None:
        fail("--recompute-granularity full with --recompute-method needs --recompute-num-layers N.")
    check_slime_megatron_flags(args)
    if args.context_parallel_size > 1 and not train_spec(args).megatron_parallelism:
        fail(
            f"--context-parallel-size {args.context_parallel_size} with --train-backend {args.train_backend}: "
            "context parallelism is built for the megatron backend only; use --train-backend megatron or "
            "--context-parallel-size 1."
        )
    if not train_spec(args).model_from_megatron_flags:
        return
    if not args.debug_rollout_only:
        check_vision_tower(args.hf_checkpoint)  # before the MODEL_ARGS cross-check, which would ask for flags in vain
        check_deepstack_layout(args)
    resolve_training_options(args)
    check_spec(args)  # a --spec that does not load fails here, before Ray starts
    if args.ckpt_format != "torch_dist":
        fail(f"--ckpt-format {args.ckpt_format}: the megatron backend here reads and writes torch_dist checkpoints "
             "only; drop the flag (tools/convert_hf_to_torch_dist.py makes one from an HF checkpoint).")
    if args.transformer_impl == "transformer_engine" and not megatron_model.te_available() and not args.dry_run:
        logger.warning("--transformer-impl transformer_engine: TransformerEngine is not installed here, so the "
                       "training ranks build megatron-core's local layer spec (torch SDPA attention); pass "
                       "--transformer-impl local to say so, or install transformer-engine.")
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.num_attention_heads and args.num_attention_heads % tp:
        fail(
            f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads {args.num_attention_heads}; "
            f"use a TP size that divides it ({divisors(args.num_attention_heads)})."
        )
    groups = query_groups(args)
    if args.group_query_attention and groups % tp:
        fail(
            f"--tensor-model-parallel-size {tp} does not divide --num-query-groups {groups}; each TP rank needs "
            f"whole key/value heads: use TP in {divisors(groups)}."
        )
    if args.num_experts and args.moe_token_dispatcher_type == "allgather":
        # slime's rule: the allgather dispatcher needs the same number of tokens on every expert-parallel rank,
        # which RL micro-batches of different lengths do not have, so MoE models always use alltoall.
        logger.info("--moe-token-dispatcher-type allgather does not handle variable sequence lengths; using "
                    "alltoall (as slime does).")
        args.moe_token_dispatcher_type = "alltoall"
    if args.num_experts and args.num_experts % ep:
        fail(
            f"--expert-model-parallel-size {ep} does not divide --num-experts {args.num_experts}; use EP in "
            f"{divisors(args.num_experts)}."
        )
    if args.num_layers:
        pipeline_layer_split(args)
    if args.context_parallel_size > 1:
        check_context_parallel(args)
    if args.vocab_size is not None and args.vocab_size <= 0:
        fail(f"--vocab-size {args.vocab_size}: must be positive.")


def check_context_parallel(args: argparse.Namespace) -> None:
    """--context-parallel-size > 1 runs packed micro-batches through slime's own attention (the zigzag split of
    slime/backends/megatron_utils/cp_layout.py): refuse what it does not cover."""
    cp = args.context_parallel_size
    if args.qkv_format != "thd":
        fail(f"--context-parallel-size {cp} with --qkv-format {args.qkv_format}: context parallelism splits packed "
             "micro-batches only; use --qkv-format thd (the default).")
    if megatron_model.uses_te(args):
        fail(f"--context-parallel-size {cp}: TransformerEngine's attention is not wired for context parallelism "
             "here (slime's own attention gathers keys and values over the CP group); pass --transformer-impl local.")
    if args.loss_type == "custom_loss":
        fail(f"--context-parallel-size {cp} with --loss-type custom_loss: a custom loss receives the logits, which "
             "hold only each CP rank's zigzag chunks here; use --context-parallel-size 1.")
