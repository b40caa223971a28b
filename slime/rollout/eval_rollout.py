"""The eval rollout (`generate_rollout(..., evaluation=True)`, slime's `eval_rollout`): every prompt of each
eval dataset graded, returned as `{name: {"rewards", "truncated", "samples"}}`.

The datasets are `args.eval_datasets` (`EvalDatasetConfig`s): `--n-samples-per-eval-prompt` samples each, eval
sampling flags falling back to the rollout's, a dataset's own settings over both. As in slime: prompts are read
with the dataset's keys and chat-template settings and cut by `--eval-max-prompt-len` only (image tokens count);
with `multimodal_keys` (the dataset's, else `--multimodal-keys`) each row's images are read for `--hf-checkpoint`'s
processor as the training data's are, and each request sends them as `image_data`; each sample's
metadata goes through `config.inject_metadata` (`rm_type`, `metadata_overrides`); the dataset's
`custom_generate_function_path` / `custom_rm_path` become the samples' `generate_function_path` /
`custom_rm_path`; its `no_stop_trim`, `repetition_penalty` and `min_new_tokens` join the sampling params
(`eval_sampling_params`).
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from slime.rollout.generation import (
    _abort_event,
    build_sampling_params,
    check_failed_ratio,
    generate_and_rm_group,
    get_processor,
    get_tokenizer,
)
from slime.utils.data import Dataset
from slime.utils.eval_config import EvalDatasetConfig, args_for, eval_datasets
from slime.utils.types import Sample

_eval_dataset_cache: dict[tuple, Any] = {}


def _or(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def eval_prompts(args, config: EvalDatasetConfig) -> Dataset:
    """The prompts of one eval dataset, read once per (dataset, keys, template, model, length limit): its own
    keys and chat-template settings (falling back to the flags'), prompts over `--eval-max-prompt-len` dropped
    (slime's limit for eval prompts; unset: none dropped)."""
    template = _or(config.apply_chat_template, args.apply_chat_template)
    template_kwargs = _or(config.apply_chat_template_kwargs, args.apply_chat_template_kwargs)
    images = config.multimodal_keys  # the dataset's, else --multimodal-keys
    key = config.cache_key + (args.hf_checkpoint, args.eval_max_prompt_len, template,
                              json.dumps(template_kwargs, sort_keys=True), json.dumps(images, sort_keys=True))  # fmt: skip
    if key not in _eval_dataset_cache:
        _eval_dataset_cache[key] = Dataset(
            config.path,
            get_tokenizer(args),
            get_processor(args) if images else None,
            args.eval_max_prompt_len,
            multimodal_keys=images,
            prompt_key=config.input_key,
            label_key=config.label_key,
            metadata_key=config.metadata_key,
            tool_key=config.tool_key,
            apply_chat_template=template,
            apply_chat_template_kwargs=template_kwargs,
            flag=f"--eval-prompt-data {config.name}",
            length_flag="--eval-max-prompt-len",
        )
    return _eval_dataset_cache[key]


def eval_sampling_params(args, config: EvalDatasetConfig) -> dict[str, Any]:
    """The sampling params of a dataset's eval requests: `build_sampling_params` of the eval flags with the
    dataset's overrides on them, plus, when set, its `no_stop_trim`, `repetition_penalty` and `min_new_tokens`
    (falling back to `--eval-min-new-tokens`)."""
    params = build_sampling_params(args_for(args, config), evaluation=True)
    extra = {
        "no_stop_trim": config.no_stop_trim,
        "repetition_penalty": config.repetition_penalty,
        "min_new_tokens": _or(config.min_new_tokens, args.eval_min_new_tokens),
    }
    params.update({k: v for k, v in extra.items() if v is not None})
    return params


def eval_groups(config: EvalDatasetConfig, dataset: Dataset, n: int) -> list[list[Sample]]:
    """`n` copies of each prompt of `dataset`, numbered, with the dataset's metadata (`rm_type`,
    `metadata_overrides`: `config.inject_metadata`), generate function and reward function on each."""
    groups = []
    for i, prompt in enumerate(dataset.samples):
        group = []
        for j in range(n):
            s = copy.deepcopy(prompt)
            s.group_index, s.index = i, i * n + j
            s.metadata = config.inject_metadata(s.metadata)
            s.generate_function_path = config.custom_generate_function_path
            s.custom_rm_path = config.custom_rm_path
            group.append(s)
        groups.append(group)
    return groups


async def eval_rollout_async(args, rollout_id: int) -> dict[str, dict[str, list]]:
    configs = eval_datasets(args)
    if not configs:
        raise ValueError("evaluation needs --eval-prompt-data name path [name path ...] or --eval-config FILE")
    reward_key = args.eval_reward_key or args.reward_key
    datasets = [(config, eval_prompts(args, config)) for config in configs]

    async def one(config: EvalDatasetConfig, dataset: Dataset) -> list[Sample]:
        ds_args = args_for(args, config)
        params = eval_sampling_params(args, config)
        groups = eval_groups(config, dataset, int(config.n_samples_per_eval_prompt or 1))
        results = await asyncio.gather(*(generate_and_rm_group(ds_args, g, params, evaluation=True) for g in groups))
        return [s for g in results for s in g]

    token = _abort_event.set(asyncio.Event())
    try:
        per_set = await asyncio.gather(*(one(*d) for d in datasets))
    finally:
        _abort_event.reset(token)
    out = {}
    for (config, _), samples in zip(datasets, per_set):
        name = config.name
        check_failed_ratio(
            args,
            [s for s in samples if s.status == Sample.Status.FAILED],
            len(samples),
            f"eval {name} (rollout {rollout_id})",
        )
        out[name] = {
            "rewards": [s.scalar_reward(reward_key) for s in samples],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
            "samples": samples,
        }
    return out
