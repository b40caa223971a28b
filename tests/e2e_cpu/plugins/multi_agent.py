"""multi_agent pattern: a `--rollout-function-path` of its own that drives slime's `generate_and_rm_group` per
group, with a `--custom-generate-function-path` that runs two agents on each prompt (a solver, then a critic
that reads the solver's answer) and returns both as trained samples of one rollout (`list[Sample]` sharing the
prompt's `rollout_id`). The rollout reports a metric of its own; with `evaluation=True` it returns slime's
eval shape.
"""

from __future__ import annotations

import copy

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample

from tests.e2e_cpu.plugins.record import record


async def solve_and_critique(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> list[Sample]:
    solver = await generate(args, copy.deepcopy(sample), dict(sampling_params))
    critic = copy.deepcopy(sample)
    critic.prompt = f"{sample.prompt} answer {solver.response} is it right?"
    critic = await generate(args, critic, dict(sampling_params))
    rollout_id = sample.rollout_id if sample.rollout_id is not None else sample.index
    for role, s in (("solver", solver), ("critic", critic)):
        s.metadata["role"] = role
        s.rollout_id = rollout_id
    return [solver, critic]


async def reward(args, sample: Sample) -> float:
    words = sample.response.split()
    return 1.0 if words and words[0] == str(sample.label) else 0.0


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    state = GenerateState(args)

    async def groups_of(batch):
        return [await generate_and_rm_group(args, g, state.sampling_params, evaluation=evaluation) for g in batch]

    if evaluation:
        samples = [s for g in run(groups_of(data_source.get_samples(2))) for s in g]
        return RolloutFnEvalOutput(data={"agents": {"rewards": [s.reward for s in samples],
                                                    "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
                                                    "samples": samples}})
    groups = run(groups_of(data_source.get_samples(args.rollout_batch_size)))
    record("multi_agent_rollout", rollout_id=rollout_id, group_sizes=[len(g) for g in groups],
           rollout_ids=[[s.rollout_id for s in g] for g in groups], roles=[[s.metadata["role"] for s in g] for g in groups])
    return RolloutFnTrainOutput(samples=groups, metrics={"multi_agent/samples_per_group": len(groups[0])})
