"""What slime/backends/training/offload.py relies on to move an FSDP2 model with `module.to(device)`: FSDP2's
`_apply` keeps every parameter object (DTensors are swapped in place) while their storage is replaced, and
re-registers the new shards, so the optimizer, which holds the parameter objects, still trains the module, and the
forward reads the new storage. A device move is an `_apply` that copies every tensor; on CPU the same `_apply`
with a copy (`clone`) exercises it. Runs in a child process (its own default process group)."""

from __future__ import annotations

import multiprocessing as mp

import pytest


def _check(out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        y_before = model(x)
    objects = [id(p) for p in model.parameters()]
    storage = [p._local_tensor.data_ptr() for p in model.parameters()]
    model._apply(lambda t: t.clone())  # as .to(another device): a new tensor for every parameter
    with torch.no_grad():
        y_after = model(x)
    weights = [p.detach().full_tensor().clone() for p in model.parameters()]
    model(x).sum().backward()
    opt.step()
    out.put({
        "same_objects": objects == [id(p) for p in model.parameters()],
        "new_storage": all(a != p._local_tensor.data_ptr() for a, p in zip(storage, model.parameters())),
        "optimizer_holds_them": [id(p) for g in opt.param_groups for p in g["params"]] == objects,
        "forward_unchanged": torch.equal(y_before, y_after),
        "step_trains_module": all(not torch.equal(w, p.detach().full_tensor())
                                  for w, p in zip(weights, model.parameters())),
    })
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_apply_keeps_parameters_and_optimizer_references():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_check, args=(out,), daemon=True)
    proc.start()
    try:
        result = out.get(timeout=90)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert result == {"same_objects": True, "new_storage": True, "optimizer_holds_them": True,
                      "forward_unchanged": True, "step_trains_module": True}
    assert proc.exitcode == 0
