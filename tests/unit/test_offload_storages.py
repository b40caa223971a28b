"""Parking a tensor's storage (`park_storage`: the offloader's move of a parameter that no DDP buffer holds) and which
optimizer tensors the offloader leaves to the module / buffer moves (slime/backends/training/offload.py):
those on a storage the modules or the DDP buffers hold, views included (an optimizer that keeps device-side views
of the weights, as megatron-core's optimizer CPU offload can, must not have them moved on their own: replacing a
view's `.data` cuts it loose from the weights it updates)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slime.backends.training.offload import TrainState, _storage, held_storages, park_storage, unpark_storage


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


def test_a_parked_storage_is_freed_and_comes_back_in_place_views_included():
    weight = torch.nn.Parameter(torch.randn(3, 4))
    view = weight.data[1:]  # shares the storage: parked and restored with it
    values, tensor_id = weight.detach().clone(), id(weight)
    host = park_storage(weight)
    assert weight.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert host.dtype == torch.uint8 and host.numel() == values.numel() * values.element_size()
    with torch.no_grad():
        values_then = values * 2
    unpark_storage(weight, host)
    assert id(weight) == tensor_id and torch.equal(weight.detach(), values) and torch.equal(view, values[1:])
    with torch.no_grad():
        weight.mul_(2)
    assert park_storage(weight, host) is host  # the host copy of the last offload is reused
    unpark_storage(weight, host)
    assert torch.equal(weight.detach(), values_then)
    assert park_storage(weight, torch.empty(3, dtype=torch.uint8)) is not host  # one of another size is not


def test_a_parked_parameter_keeps_its_gradient_accumulator():
    """megatron-core DDP hooks the parameter's AccumulateGrad node (`param.expand_as(param).grad_fn.next_functions`);
    the node survives a park, and is dropped by a `.data` of another type (dtype here; device on a GPU)."""
    def hooked(p):
        fired = []
        node = p.expand_as(p).grad_fn.next_functions[0][0]
        node.register_hook(lambda *_: fired.append(True))
        return node, fired  # the node lives while held (megatron-core DDP keeps them in `grad_accs`)

    parked, swapped = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    (node_parked, fired_parked), (node_swapped, fired_swapped) = hooked(parked), hooked(swapped)
    unpark_storage(parked, park_storage(parked))
    kept = swapped.data
    swapped.data = kept.double()
    swapped.data = kept
    (parked.sum() + swapped.sum()).backward()
    assert fired_parked == [True] and fired_swapped == []
