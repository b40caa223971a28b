"""The plugin hooks are resolved once per process, at its entry (slime/utils/hooks.py): a bad path fails there,
before any sample is generated, and a hook is loaded once however many samples call it.

The plugins are this module's functions (loaded by dotted path), and a plugin file written per test whose hook is
served by a module `__getattr__` that counts how often it is looked up: each load of the hook looks it up, each
call of it does not. Generation is a scripted custom generate function (no engine, as in test_rollout_hooks.py).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from slime.ray.rollout import RolloutManager
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.rm_hub import async_rm
from slime.rollout.sglang_rollout import generate_rollout
from slime.rollout.train_data import save_debug_samples
from slime.utils.hooks import Hooks, hooks_of, sample_hook
from slime.utils.http_utils import run_sync
from slime.utils.misc import HOOK_CONTRACTS
from slime.utils.types import Sample
from tests.args import make_args

HERE = __name__
GENERATED: list[int] = []  # indices of the samples scripted_generate was called for

COUNTED_PLUGIN = '''
counts = {"lookups": 0, "calls": 0}


def _reward(args, sample):
    counts["calls"] += 1
    return float(sample.index)


def __getattr__(name):
    if name == "reward":
        counts["lookups"] += 1
        return _reward
    raise AttributeError(name)
'''


async def scripted_generate(args, sample, sampling_params):
    GENERATED.append(sample.index)
    sample.tokens = [1, 2, 3, 4]
    sample.response = "r"
    sample.response_length = 2
    sample.loss_mask = [1, 1]
    sample.rollout_log_probs = [-0.1, -0.2]
    sample.status = Sample.Status.COMPLETED
    return sample


def filter_without_group(args):
    return True


def _args(**kw):
    base = dict(disable_rollout_global_dataset=True, custom_generate_function_path=f"{HERE}.scripted_generate",
                rollout_max_response_len=4, rm_type="toy")
    return make_args(**{**base, **kw})


def _counted_plugin(tmp_path):
    """(path of the counted reward, its module's counts)."""
    file = tmp_path / "counted_reward.py"
    file.write_text(COUNTED_PLUGIN)
    path = f"{file}:reward"
    sample_hook(path, "--custom-rm-path", "sample.custom_rm_path")  # loads it: the module is now imported
    return path, sys.modules["_slime_plugin_counted_reward"].counts


def test_the_record_has_one_field_per_hook_flag():
    flags = [f.metadata["flag"] for f in dataclasses.fields(Hooks)]
    assert sorted(flags) == sorted(HOOK_CONTRACTS)


def test_a_bad_hook_path_fails_when_the_rollout_manager_starts(tmp_path):
    template = str(tmp_path / "rollout_{rollout_id}.pt")
    save_debug_samples(template, 0, [Sample(group_index=0, index=0, tokens=[1, 2], response_length=1, reward=1.0,
                                            status=Sample.Status.COMPLETED, loss_mask=[1])])
    args = make_args(load_debug_rollout_data=template)
    RolloutManager(args, None)  # the good args start
    # e.g. args built without the command-line check, or a plugin edited between the check and the start
    args.custom_rm_path = f"{HERE}.no_such_reward"
    with pytest.raises(AttributeError, match=r"--custom-rm-path=tests\.unit\.test_hooks\.no_such_reward: "
                                             r"'tests\.unit\.test_hooks' has no attribute 'no_such_reward'"):
        RolloutManager(args, None)
    args.custom_rm_path = None
    args.dynamic_sampling_filter_path = f"{HERE}.filter_without_group"
    with pytest.raises(TypeError, match=r"--dynamic-sampling-filter-path=tests\.unit\.test_hooks\."
                                        r"filter_without_group: .* cannot be called as fn\(args, group\)"):
        RolloutManager(args, None)


def test_a_bad_hook_path_fails_before_any_sample_is_generated():
    args = _args()
    data_source = RolloutDataSourceWithBuffer(args)
    # a hook slime calls only once the rollout's groups are chosen
    args.rollout_sample_filter_path = f"{HERE}.no_such_filter"
    GENERATED.clear()
    with pytest.raises(AttributeError, match=r"--rollout-sample-filter-path=tests\.unit\.test_hooks\.no_such_filter"):
        generate_rollout(args, 0, data_source)
    assert GENERATED == []


def test_a_flag_hook_is_loaded_once_per_process(tmp_path):
    path, counts = _counted_plugin(tmp_path)
    args = _args(custom_rm_path=path, rollout_batch_size=2, n_samples_per_prompt=3, global_batch_size=6)
    hooks_of(args)  # the process's entry
    lookups = counts["lookups"]
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    output = generate_rollout(args, 1, RolloutDataSourceWithBuffer(args))
    assert counts["calls"] == 2 * 2 * 3 and sorted(s.reward for g in output.samples for s in g) == list(range(6))
    assert counts["lookups"] == lookups  # called 12 times, loaded no more


def test_a_sample_hook_is_loaded_once_per_distinct_path(tmp_path):
    path, counts = _counted_plugin(tmp_path)
    lookups = counts["lookups"]
    args = _args()
    rewards = [run_sync(async_rm(args, Sample(index=i, response="r", custom_rm_path=path))) for i in range(5)]
    assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0] and counts["calls"] == 5
    assert counts["lookups"] == lookups
