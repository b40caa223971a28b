"""Which optimizer tensors the offloader leaves to the module / buffer moves (slime/backends/training/offload.py):
those on a storage the modules or the DDP buffers hold, views included (an optimizer that keeps device-side views
of the weights, as megatron-core's optimizer CPU offload can, must not have them moved on their own: replacing a
view's `.data` cuts it loose from the weights it updates)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slime.backends.training.offload import TrainState, _storage, held_storages


def test_views_of_the_weights_and_of_the_buffers_are_held():
    model = torch.nn.Linear(4, 3)
    param_buffer, grad_buffer = torch.zeros(20), torch.zeros(20)
    chunk = torch.nn.Module()
    chunk.buffers = [SimpleNamespace(param_data=param_buffer, grad_data=grad_buffer, params=[])]
    held = held_storages(TrainState(weights=[model], ddp_chunks=[chunk]))
    for view in (model.weight.view(-1)[2:5], model.bias[1:], param_buffer[4:8], grad_buffer[:3]):
        assert _storage(view) in held
    master = model.weight.detach().clone()  # a master copy has storage of its own: the offloader moves it
    assert _storage(master) not in held
