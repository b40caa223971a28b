"""`slime.rollout.sglang_rollout` is slime's path onto the default rollout, whose code lives in
`slime.rollout.generation`, `.train_rollout` and `.eval_rollout`: the names slime's plugins and this project's
tests import from it are the objects of those modules (a plugin that holds one shares its state)."""

from slime.rollout import eval_rollout, generation, sglang_rollout, train_rollout

# what slime's plugins and examples import from it, and what the tests here do
NAMES = {
    generation: ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "get_model_url",
                 "get_tokenizer", "init_response", "prompt_ids", "build_sampling_params", "append_model_tokens",
                 "sampling_seed", "check_failed_ratio", "_mark_failed", "_abort_event", "router_url",
                 "post_generate", "abort_engines"],
    train_rollout: ["generate_rollout", "generate_rollout_async", "finish_rollout"],
    eval_rollout: ["eval_sampling_params", "eval_prompts", "eval_groups", "eval_rollout_async"],
}


def test_the_facade_hands_out_the_home_modules_objects():
    for home, names in NAMES.items():
        for name in names:
            assert getattr(sglang_rollout, name) is getattr(home, name), (home.__name__, name)


def test_the_facade_is_the_generation_module_so_what_is_set_on_it_is_read():
    """slime's tests monkeypatch `sglang_rollout.GenerateState` / `.generate`: the generation code must see it."""
    import importlib
    import sys

    assert sglang_rollout is generation and sys.modules["slime.rollout.sglang_rollout"] is generation
    assert importlib.import_module("slime.rollout.sglang_rollout") is generation
    original = generation.GENERATE_BACKOFF_S
    try:
        sglang_rollout.GENERATE_BACKOFF_S = original + 1.0
        assert generation.GENERATE_BACKOFF_S == original + 1.0
    finally:
        generation.GENERATE_BACKOFF_S = original
