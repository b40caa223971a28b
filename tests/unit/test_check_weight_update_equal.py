"""--check-weight-update-equal: the flag's validation, the call order of the loop, and the engine-side checker."""

import logging
from types import SimpleNamespace

import pytest
import torch

from slime.backends.hf_engine.weight_checker import WeightChecker
from slime.config.arg_groups._common import SlimeArgumentError
from slime.ray import launcher, loop
from slime.ray.rollout import RolloutManager
from tests.args import make_args


class Remote:
    """A Ray-method stand-in: `.remote(...)` records the call and returns its result directly."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *a, **kw):
        self.calls.append((self.name, kw.get("action", a[0] if a else None)))
        return self.name


class FakeManager:
    def __init__(self):
        self.calls = []
        for name in ("check_weights", "before_weight_update", "after_weight_update"):
            setattr(self, name, Remote(self.calls, name))


class FakeActor:
    def __init__(self, calls):
        self.calls = calls

    def update_weights(self, engines, version):
        self.calls.append(("update_weights", version))


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(loop.ray, "get", lambda ref, **kw: ref)


def test_flag_parses_and_no_longer_warns_not_implemented(caplog, tiny_model_dir):
    assert make_args().check_weight_update_equal is False
    with caplog.at_level(logging.WARNING):
        args = make_args("--check-weight-update-equal", "--disable-rollout-global-dataset", debug_train_only=False,
                         rollout_num_gpus=1, hf_checkpoint=tiny_model_dir)
    assert args.check_weight_update_equal is True
    assert not [r for r in caplog.records if "weight" in r.getMessage()]


def test_flag_with_train_only_says_nothing_is_checked(caplog):
    with caplog.at_level(logging.WARNING):
        make_args("--check-weight-update-equal")  # the baseline is --debug-train-only: no engines
    assert [r for r in caplog.records if "no engines, nothing is checked" in r.getMessage()]


def test_flag_refuses_rollout_only_runs_that_no_push_would_restore():
    with pytest.raises(SlimeArgumentError, match="--check-weight-update-equal.*--debug-rollout-only"):
        make_args("--check-weight-update-equal", "--debug-rollout-only", debug_train_only=False)


def test_snapshot_reset_then_only_the_first_push_is_compared(no_ray):
    manager = FakeManager()
    run = SimpleNamespace(rollout_manager=manager, actor=FakeActor(manager.calls), weight_check_pending=False)
    launcher.start_weight_check(run)
    assert manager.calls == [("check_weights", "snapshot"), ("check_weights", "reset_tensors")]
    manager.calls.clear()
    assert loop.push_weights(run, [], 0) == 1
    assert manager.calls == [("before_weight_update", None), ("update_weights", 1), ("after_weight_update", 1),
                             ("check_weights", "compare")]
    manager.calls.clear()
    loop.push_weights(run, [], 1)
    assert ("check_weights", "compare") not in manager.calls


def test_push_without_the_flag_compares_nothing(no_ray):
    manager = FakeManager()
    run = SimpleNamespace(rollout_manager=manager, actor=FakeActor(manager.calls), weight_check_pending=False)
    loop.push_weights(run, [], 0)
    assert not [c for c in manager.calls if c[0] == "check_weights"]


def test_rollout_manager_fans_the_action_out_to_every_engine(no_ray):
    calls = []
    manager = object.__new__(RolloutManager)
    manager.engines = [SimpleNamespace(check_weights=Remote(calls, f"engine{i}")) for i in range(3)]
    manager.engine_urls = ["u0", "u1", "u2"]
    assert manager.check_weights("compare") == ["engine0", "engine1", "engine2"]
    assert calls == [(f"engine{i}", "compare") for i in range(3)]


def make_params():
    torch.manual_seed(0)
    return {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16), "rotary.inv_freq": torch.arange(4.0),
            "ids": torch.arange(5)}


def test_checker_compare_passes_only_after_every_tensor_is_restored():
    params = make_params()
    original = {n: t.clone() for n, t in params.items()}
    checker = WeightChecker(params)
    checker.handle("snapshot")
    checker.handle("reset_tensors")
    assert not torch.equal(params["w"], original["w"]) and not torch.equal(params["ids"], original["ids"])
    assert torch.equal(params["rotary.inv_freq"], original["rotary.inv_freq"])  # derived buffers are left alone
    for name in ("w", "ids"):
        params[name].copy_(original[name])
    with pytest.raises(RuntimeError, match=r"check tensor equality failed:\nname=b ") as info:
        checker.handle("compare")
    assert "name=w" not in str(info.value)
    params["b"].copy_(original["b"])
    assert checker.handle("compare") is None


def test_checker_checksum_follows_the_values_and_errors_are_clear():
    params = make_params()
    checker = WeightChecker(params)
    with pytest.raises(RuntimeError, match="snapshot first"):
        checker.handle("compare")
    with pytest.raises(ValueError, match="Unsupported action='bogus'"):
        checker.handle("bogus")
    before = checker.handle("checksum")
    assert set(before["ranks"][0]["checksums"]) == {"w", "b", "ids"}
    params["w"][0, 0] += 1
    after = checker.handle("checksum")
    assert after["per_engine_checksum"] != before["per_engine_checksum"]
    assert after["ranks"][0]["checksums"]["b"] == before["ranks"][0]["checksums"]["b"]


def test_a_failed_compare_stops_the_run_saying_which_flag_checked(no_ray):
    class FailingCompare(Remote):
        def remote(self, *a, **kw):
            super().remote(*a, **kw)
            if kw.get("action") == "compare":
                raise RuntimeError("engine rank 0 POST /weights_checker failed: name=lm_head.weight max_abs_err=0.5")
            return self.name

    manager = FakeManager()
    manager.check_weights = FailingCompare(manager.calls, "check_weights")
    run = SimpleNamespace(rollout_manager=manager, actor=FakeActor(manager.calls), weight_check_pending=True)
    with pytest.raises(RuntimeError, match=r"--check-weight-update-equal: .*name=lm_head\.weight"):
        loop.push_weights(run, [], 0)
