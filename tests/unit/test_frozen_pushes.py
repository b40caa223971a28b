"""Which pushes leave frozen parameters out (slime/weight_sync/frozen.py); the pushes themselves are checked
end to end in tests/e2e_cpu/test_fsdp_vision_frozen.py and test_megatron_vision_language.py."""

from __future__ import annotations

import torch

from slime.weight_sync.frozen import FrozenPushes, frozen_parameter_names, sends_everything
from slime.weight_sync.push import EnginePush
from tests.args import make_args


def test_sends_everything_on_the_first_push_after_a_failure_a_restart_or_for_the_route():
    assert sends_everything(None, ["3", "3"], False)  # first push (or the last one failed)
    assert not sends_everything("3", ["3", "3"], False)
    assert sends_everything("3", ["3", "default"], False)  # engine 1 restarted: its server's initial version
    assert sends_everything("3", ["3", "3"], True)  # a whole-checkpoint route


def test_engines_that_release_their_weights_get_every_tensor():
    pushes = FrozenPushes({"visual.w"}, engines_release=True)
    assert pushes.left_out(EnginePush(), []) == frozenset()


def test_a_run_without_frozen_parameters_asks_the_engines_nothing(monkeypatch):
    import slime.weight_sync.frozen as frozen

    asked = []
    monkeypatch.setattr(frozen, "engine_weight_versions", lambda engines: asked.append(engines) or ["1"])
    assert FrozenPushes(set(), engines_release=False).left_out(EnginePush(), ["engine"]) == frozenset()
    assert asked == []  # no per-push version call when nothing is frozen
    pushes = FrozenPushes({"visual.w"}, engines_release=False)
    assert pushes.left_out(EnginePush(), ["engine"]) == frozenset()  # first push: everything
    pushes.pushed(1)
    assert pushes.left_out(EnginePush(), ["engine"]) == {"visual.w"} and len(asked) == 2


def test_routes_say_whether_they_need_every_tensor(tmp_path):
    from slime.weight_sync.push import DiskPush

    assert EnginePush().needs_every_tensor() is False
    args = make_args(update_weight_transport="disk", update_weight_disk_dir=str(tmp_path))
    assert DiskPush(args).needs_every_tensor() is True


def test_frozen_parameter_names_are_the_parameters_without_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    model.register_buffer("counter", torch.zeros(1))  # a buffer is never taken for a frozen parameter
    assert frozen_parameter_names(model.named_parameters()) == {"0.weight", "0.bias"}
    assert frozen_parameter_names(model.named_buffers()) == set()
