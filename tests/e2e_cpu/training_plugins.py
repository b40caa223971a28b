"""Plugins for tests/e2e_cpu/test_training_hooks.py, written to slime's contracts for the training-side hooks.

Each call appends one JSON line to the file named by $SLIME_TEST_HOOK_LOG (what it was called with), and each
plugin has an effect the test can see in the training results.
"""

from __future__ import annotations

import json
import os

import torch


def record(event: str, **data) -> None:
    """One line per call: the event, the training rank (0 before the process group exists) and `data`."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.environ["SLIME_TEST_HOOK_LOG"], "a") as f:
        f.write(json.dumps({"event": event, "rank": rank, **data}) + "\n")


# --rollout-data-postprocess-path
def record_rollout_data(args, rollout_id, rollout_data):
    record("rollout_data_postprocess", args=type(args).__name__, rollout_id=rollout_id,
           keys=sorted(rollout_data), partition=rollout_data["partition"],
           total_lengths=rollout_data["total_lengths"], response_lengths=rollout_data["response_lengths"],
           mask_dtype=str(rollout_data["loss_masks"][0].dtype),
           lengths={k: [len(x) for x in rollout_data[k]] for k in ("loss_masks", "advantages", "log_probs",
                                                                    "ref_log_probs", "rollout_log_probs")
                    if k in rollout_data})


def zero_loss_masks(args, rollout_id, rollout_data):
    """No token of the rollout is trained on."""
    record_rollout_data(args, rollout_id, rollout_data)
    for mask in rollout_data["loss_masks"]:
        mask.zero_()


# --custom-megatron-init-path
def on_init(args):
    from megatron.core import parallel_state

    record("init", args=type(args).__name__, parallel_ready=parallel_state.model_parallel_is_initialized())


# --custom-megatron-init-path: the parallel layout the rank was given (tests/e2e_cpu/test_context_parallel_train.py)
def record_layout(args):
    from megatron.core import parallel_state as ps

    record("layout", cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
           dp=ps.get_data_parallel_world_size(), tp=ps.get_tensor_model_parallel_world_size())


# --custom-megatron-before-log-prob-hook-path: the reference model predicts uniformly (its final norm zeroed)
def before_log_prob(args, model, store_prefix):
    record("before_log_prob", store_prefix=store_prefix, chunks=len(model), training=model[0].training)
    if store_prefix == "ref_":
        with torch.no_grad():
            for chunk in model:
                chunk.decoder.final_layernorm.weight.zero_()


# --custom-megatron-before-train-step-hook-path: no optimizer step moves the weights
def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    record("before_train_step", rollout_id=rollout_id, step_id=step_id, chunks=len(model),
           optimizer=type(optimizer).__name__, scheduler=type(opt_param_scheduler).__name__,
           grads_zeroed=all(float(buffer.grad_data.abs().sum()) == 0.0 for chunk in model for buffer in chunk.buffers))
    for group in optimizer.param_groups:
        group["lr"] = 0.0


def _local_spec(config, vp_stage=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from slime.backends.megatron_utils.sdpa_attention import with_sdpa_attention

    return with_sdpa_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                          normalization="RMSNorm", vp_stage=vp_stage))


# --custom-model-provider-path (slime's signature; args from plugins.get_args, as slime's from megatron.training)
def model_provider(pre_process, post_process, vp_stage=None, config=None):
    from megatron.core.models.gpt import GPTModel

    from slime.backends.megatron_utils.args import gpt_model_kwargs
    from slime.backends.megatron_utils.plugins import get_args

    record("model_provider", pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
           config=type(config).__name__)
    return GPTModel(config, _local_spec(config, vp_stage), pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, **gpt_model_kwargs(get_args()))


# --spec tests.e2e_cpu.training_plugins layer_spec
def layer_spec(args, config, vp_stage):
    record("spec", args=type(args).__name__, config=type(config).__name__, vp_stage=vp_stage)
    return _local_spec(config, vp_stage)


# --custom-megatron-before-train-step-hook-path: a NaN weight makes the step's loss NaN
def poison_final_norm(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    with torch.no_grad():
        for chunk in model:
            chunk.module.decoder.final_layernorm.weight.fill_(float("nan"))
