"""`tools/make_tiny_model.py --arch qwen2_5_vl --size qwen2.5-vl-3b`: the random-init Qwen2.5-VL-3B-Instruct shape
of GPU acceptance row 25, checked without writing its 7.5 GB (config.json only; the weights at one layer:
tests/e2e_cpu/test_vlm_shape_weights.py)."""

from __future__ import annotations

import json

import pytest
import torch

from slime.backends.megatron_utils.config_check import find_mismatches, load_hf_config
from slime.config.arguments import parse_args
from slime.utils.errors import SlimeArgumentError
from tests.conftest import model_args
from tests.unit.test_model_scripts import argv_for

# Qwen/Qwen2.5-VL-3B-Instruct's config.json on the Hub (its vision fields beyond hidden_size / out_hidden_size /
# patch size / tokens_per_second are transformers' Qwen2_5_VLVisionConfig defaults, which it relies on)
HUB_TEXT = {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
            "intermediate_size": 11008, "vocab_size": 151936, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "max_position_embeddings": 128000}
HUB_VISION = {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 2048, "tokens_per_second": 2,
              "hidden_act": "silu", "in_channels": 3}
PUBLISHED_PARAMETERS = 3.75e9  # the Hub's safetensors size of Qwen2.5-VL-3B-Instruct


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tools.make_tiny_model import write_config

    out = str(tmp_path_factory.mktemp("qwen2.5-vl-3b"))
    write_config(out, arch="qwen2_5_vl", size="qwen2.5-vl-3b")
    return out


def test_config_is_the_published_shape(folder):
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert {k: text[k] for k in HUB_TEXT} == HUB_TEXT
    assert text["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    assert {k: vision[k] for k in HUB_VISION} == HUB_VISION
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["tie_word_embeddings"] is True
    # the vision tokens' ids are the folder's tokenizer's (which is smaller than the config's vocabulary)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert cfg[key] == tok.convert_tokens_to_ids(token) < len(tok) < text["vocab_size"], key


def test_parameter_count_is_the_published_one(folder):
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())  # the tied output layer counted once
    tower = sum(p.numel() for p in model.model.visual.parameters())
    print(f"\n[qwen2.5-vl-3b shape] {type(model).__name__}: {n:,} parameters ({tower:,} in the vision tower), "
          f"{2 * n / 1e9:.2f} GB in bf16")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert abs(n - PUBLISHED_PARAMETERS) < 0.005e9, n
    assert 0.66e9 < tower < 0.68e9, tower  # 32 blocks of width 1280 and the 2x2 merger into 2048
    # the --dry-run planner's count: the text model by formula (tied output, QKV bias) + the tower, exactly
    from slime.config.plan.model_size import count_params, load_model_shape

    counts = count_params(load_model_shape(folder))
    assert (counts.total, counts.vision, counts.output) == (n, tower, 0)


def test_megatron_script_matches_the_config(folder, files):
    args = parse_args(argv_for(folder, model_args("qwen2.5-vl-3b"), ranks=1) + ["--rollout-num-gpus", "1"])
    assert find_mismatches(args, load_hf_config(folder)) == []
    # transformers keeps a vision-language model's tie_word_embeddings at the top level, not in its text config:
    # the check reads it there, so the untied flag is a mismatch
    assert load_hf_config(folder)["tie_word_embeddings"] is True
    with pytest.raises(SlimeArgumentError, match="tie_word_embeddings"):
        parse_args(argv_for(folder, model_args("qwen2.5-vl-3b"), ranks=1)
                   + ["--rollout-num-gpus", "1", "--untie-embeddings-and-output-weights"])
    assert args.position_embedding_type == "mrope" and args.mrope_section == [16, 24, 24]


def test_published_size_needs_its_arch(tmp_path):
    from tools.make_tiny_model import write_config

    with pytest.raises(ValueError, match="--arch qwen2_5_vl"):
        write_config(str(tmp_path), arch="qwen3", size="qwen2.5-vl-3b")
