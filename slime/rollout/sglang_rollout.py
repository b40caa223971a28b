"""slime's path of the default rollout, `slime.rollout.sglang_rollout`: plugins written for slime import
`GenerateState`, `generate`, `generate_and_rm`, `generate_and_rm_group`, `generate_rollout`, `get_model_url`, ...
from here, and `--rollout-function-path` defaults to `slime.rollout.sglang_rollout.generate_rollout`.

A facade that nothing inside the package imports. The code lives in three modules:
- `slime.rollout.generation`: per-process state, sampling params, the /generate request, one sample and one
  group (`generate`, `generate_and_rm`, `generate_and_rm_group`), abort, failure accounting;
- `slime.rollout.train_rollout`: `generate_rollout` (the training rollout: dynamic sampling, abort of the
  surplus, partial-rollout recycling, the rollout-end hooks);
- `slime.rollout.eval_rollout`: the eval datasets' rollout (`generate_rollout(..., evaluation=True)`).

The name is an alias, not a copy: `sys.modules` maps it to `slime.rollout.generation` itself, with the training
and eval rollouts' names added to it, so what a plugin or a test sets on `sglang_rollout` (slime's tests
monkeypatch `GenerateState`, `generate`, `generate_rollout`) is what the generation code reads, as it was in
slime's single module. (Names of `train_rollout` / `eval_rollout` set here reach `generate_rollout`'s callers
through this module, not those two modules' own references.)
"""

import sys

from slime.rollout import generation

from slime.rollout.eval_rollout import (  # noqa: F401 - slime's names
    eval_groups,
    eval_prompts,
    eval_rollout_async,
    eval_sampling_params,
)
from slime.rollout.generation import (  # noqa: F401 - slime's names
    GENERATE_BACKOFF_S,
    GenerateState,
    _abort_event,
    _mark_failed,
    abort_engines,
    append_model_tokens,
    build_sampling_params,
    check_failed_ratio,
    engine_count,
    generate,
    generate_and_rm,
    generate_and_rm_group,
    get_model_url,
    get_tokenizer,
    init_response,
    mask_offpolicy,
    post_generate,
    prompt_ids,
    router_url,
    sampling_seed,
    sglang_flag_on,
)
from slime.rollout.train_rollout import (  # noqa: F401 - slime's names
    ABORT_WAIT_S,
    finish_rollout,
    generate_rollout,
    generate_rollout_async,
)

__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout", "get_model_url"]

vars(generation).update(ABORT_WAIT_S=ABORT_WAIT_S, finish_rollout=finish_rollout, generate_rollout=generate_rollout,
                        generate_rollout_async=generate_rollout_async, eval_groups=eval_groups,
                        eval_prompts=eval_prompts, eval_rollout_async=eval_rollout_async,
                        eval_sampling_params=eval_sampling_params)
sys.modules[__name__] = generation
