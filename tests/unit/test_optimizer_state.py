"""--reset-optimizer-states: after the reset, an Adam step is the step of a fresh optimizer. --use-stateless-adam
(a reset before every step) gives slime's StatelessAdam update."""

from __future__ import annotations

import torch

import pytest

from slime.backends.training.optimizer_state import reset_optimizer_states
from slime.config.arguments import SlimeArgumentError
from tests.args import make_args


def _adam(param: torch.nn.Parameter) -> torch.optim.AdamW:
    return torch.optim.AdamW([param], lr=0.1, betas=(0.9, 0.999), weight_decay=0.0)


def _step(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = grad.clone()
    optimizer.step()


def test_a_reset_adam_steps_as_a_fresh_one():
    torch.manual_seed(0)
    start = torch.randn(5)
    grads = [torch.randn(5) for _ in range(3)]
    reset, kept = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reset_optimizer, kept_optimizer = _adam(reset), _adam(kept)
    for g in grads[:2]:
        _step(reset_optimizer, reset, g)
        _step(kept_optimizer, kept, g)
    moments = [reset_optimizer.state[reset][k] for k in ("exp_avg", "exp_avg_sq")]
    assert all(m.abs().sum() > 0 for m in moments) and int(reset_optimizer.state[reset]["step"]) == 2
    reset_optimizer_states([reset_optimizer])
    assert all(m.abs().sum() == 0 for m in moments) and int(reset_optimizer.state[reset]["step"]) == 0
    assert reset_optimizer.state[reset]["exp_avg"] is moments[0]  # zeroed in place: an offloaded state stays put

    fresh = torch.nn.Parameter(reset.detach().clone())
    fresh_optimizer = _adam(fresh)
    for optimizer, param in ((reset_optimizer, reset), (fresh_optimizer, fresh), (kept_optimizer, kept)):
        _step(optimizer, param, grads[2])
    assert torch.equal(reset, fresh)
    assert not torch.allclose(kept, reset)  # from the same point, the kept history makes another step


def test_the_flag_parses_and_defaults_off():
    assert make_args().reset_optimizer_states is False
    assert make_args("--reset-optimizer-states").reset_optimizer_states is True


def test_a_reset_before_every_step_is_slimes_stateless_adam_update():
    # slime's StatelessAdam: p <- p·(1 − lr·wd) − lr·g / (|g| + eps) every step (bias correction on), whatever
    # came before.
    torch.manual_seed(0)
    lr, wd, eps = 0.1, 0.01, 1e-8
    param = torch.nn.Parameter(torch.randn(6))
    optimizer = torch.optim.AdamW([param], lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=wd)
    for _ in range(3):
        grad = torch.randn(6)
        want = param.detach() * (1 - lr * wd) - lr * grad / (grad.abs() + eps)
        reset_optimizer_states([optimizer])
        _step(optimizer, param, grad)
        torch.testing.assert_close(param.detach(), want, rtol=1e-6, atol=1e-7)


def test_stateless_adam_flag_needs_adam_and_no_saved_optimizer():
    assert make_args().use_stateless_adam is False
    assert make_args("--use-stateless-adam", "--no-save-optim").use_stateless_adam is True
    with pytest.raises(SlimeArgumentError, match="--use-stateless-adam keeps no Adam moments.*--no-save-optim"):
        make_args("--use-stateless-adam")
    with pytest.raises(SlimeArgumentError, match="--use-stateless-adam with --optimizer sgd"):
        make_args("--use-stateless-adam", "--no-save-optim", "--optimizer", "sgd")


def test_the_fsdp_trainer_refuses_sgd_at_start():
    # it steps AdamW only; before, --optimizer sgd trained with AdamW without a word
    with pytest.raises(SlimeArgumentError, match="--optimizer sgd with --train-backend fsdp: this trainer steps adam "
                                                 "only.*--train-backend megatron"):
        make_args("--train-backend", "fsdp", "--optimizer", "sgd")
    assert make_args("--train-backend", "fsdp").optimizer == "adam"
