"""--offload-train's mover on a real GPU (slime/backends/training/offload.py; skipped without CUDA).

A model and its AdamW state leave the device in the handoff's two moves (all but the weights, then the weights),
the allocator's memory drops by what they held, they come back bit for bit, the next optimizer step equals the
step of a copy that never moved, the pinned host copies are reused by the next offload, and the weights alone come
back for a push between two offloads (fault tolerance's).
"""

from __future__ import annotations

import copy

import pytest
import torch

from slime.backends.training.offload import Offloader, TrainState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 2048, device="cuda", generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_offload_in_two_moves_frees_the_device_and_comes_back_exact():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).to(device)  # 67M params
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    twin = copy.deepcopy(model)  # never moves
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    state = TrainState(weights=[model], optimizers=[opt])
    mover = Offloader(device)
    twin_bytes = start // 2  # the twin holds as much as the model and its state
    moved_state = mover.offload(state, weights=False)  # before a push: the optimizer state goes, weights stay
    assert next(model.parameters()).is_cuda and mover.state_off and not mover.weights_off
    assert moved_state >= 2 * weight_bytes * 0.99  # AdamW's exp_avg and exp_avg_sq
    moved_all = moved_state + mover.offload(state)  # after the push: the weights too
    assert not next(model.parameters()).is_cuda
    held = torch.cuda.memory_allocated(device) - twin_bytes
    print(f"\n[offload] {start / 1e9:.2f} GB allocated (with the twin), moved {moved_all / 1e9:.2f} GB; "
          f"the offloaded side holds {held / 1e6:.1f} MB")
    assert moved_all >= 3 * weight_bytes * 0.99 and held < 0.05 * twin_bytes  # >= 95% of the side freed
    assert torch.cuda.memory_reserved(device) < start  # the caching allocator's reserve went back too
    hosts = {k: host.data_ptr() for k, (_, host) in mover._host.items()}

    assert mover.onload(state) >= moved_all * 0.99 and not mover.offloaded
    for a, b in zip(model.parameters(), twin.parameters()):
        assert a.is_cuda and torch.equal(a, b)
    for a, b in zip(opt.state.values(), twin_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    _step(model, opt, 1)
    _step(twin, twin_opt, 1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)  # the step after the round trip is the step that never moved

    mover.offload(state)  # the second offload writes into the same pinned host tensors
    assert {k: host.data_ptr() for k, (_, host) in mover._host.items()} == hosts
    assert all(host.is_pinned() for _, host in mover._host.values())

    # fault tolerance's push mid-rollout: only the weights come back, then leave again
    assert mover.onload(state, weights_only=True) <= weight_bytes * 1.01
    assert next(model.parameters()).is_cuda and mover.state_off and not mover.weights_off
    assert not next(iter(opt.state.values()))["exp_avg"].is_cuda
    mover.offload(state)
    assert not next(model.parameters()).is_cuda
    mover.onload(state)
    _step(model, opt, 2)
    _step(twin, twin_opt, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_deferred_optimizer_onload_is_ready_before_the_step():
    """`onload(defer_optimizer=True)` (the Megatron trainer's): the weights are back at once, the optimizer's
    tensors are allocated at once and filled on a side stream while a forward and backward run; after
    `optimizer_ready()` the step equals the step of a copy that never moved, and an offload right after a deferred
    onload (no step between) still carries the state's values."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = TrainState(weights=[model], optimizers=[opt])
    mover = Offloader(device)

    for round_ in range(2):
        moved = mover.offload(state)
        back = mover.onload(state, defer_optimizer=True)
        assert back >= moved * 0.99 and not mover.offloaded  # allocated at once, so counted at once
        assert all(t.is_cuda for s in opt.state.values() for k, t in s.items() if k != "step")
        if round_ == 0:  # straight back out: the offload waits for the copies in flight
            mover.offload(state)
            mover.onload(state, defer_optimizer=True)
        g = torch.Generator(device="cuda").manual_seed(10 + round_)
        x = torch.randn(64, 2048, device="cuda", generator=g)
        model(x).square().mean().backward()  # beside the copies
        mover.optimizer_ready()
        opt.step()
        opt.zero_grad(set_to_none=True)
        twin(x).square().mean().backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b), round_
        for a, b in zip(opt.state.values(), twin_opt.state.values()):
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    mover.optimizer_ready()  # nothing in flight: a no-op
