"""The trainers' torch optimizers: `--reset-optimizer-states` (the history cleared at the start of every rollout's
training) and `--adam-kernel` (the kernel a torch Adam steps with).

`--reset-optimizer-states`:
Adam's moments (`exp_avg`, `exp_avg_sq`) are zeroed and its step counters set to 0 (in the per-parameter state
and in a param group that keeps one), so the rollout's first step is the step of a fresh optimizer: bias correction
starts over. The learning-rate schedule is not touched (it follows the trainer's own step count). Other state
(a momentum buffer of SGD, say) is left as it is; the trainers here build Adam.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def reset_optimizer_states(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Zero the step counters and Adam moments of every torch optimizer in `optimizers`, in place (tensors keep
    their device, dtype and identity, so an offloaded state stays where it is)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in optimizer.state.values():
            if "step" in state:
                if isinstance(state["step"], torch.Tensor):
                    state["step"].zero_()
                else:
                    state["step"] = 0
            for key in _MOMENTS:
                if key in state:
                    state[key].zero_()


def set_adam_kernel(adams: Iterable[torch.optim.Optimizer], fused: bool) -> None:
    """--adam-kernel: torch's fused AdamW kernel, or torch's default (multi-tensor on CUDA, a loop on the host), for
    each torch Adam / AdamW in `adams`. Called again after an optimizer checkpoint is loaded: torch's
    `load_state_dict` takes the saving run's choice into the parameter groups. Each `step` counter moves to where
    its kernel keeps it: the parameter's device when fused (or capturable), else the host; a copy each (megatron-core's
    load gives all parameters one tensor, which torch would advance once per parameter)."""
    for adam in adams:
        for group in (adam.defaults, *adam.param_groups):
            group["fused"], group["foreach"] = (True, False) if fused else (None, None)
        for group in adam.param_groups:
            for p in group["params"]:
                step = adam.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    adam.state[p]["step"] = step.to(p.device if fused or group["capturable"] else "cpu", copy=True)
