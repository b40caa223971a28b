"""The Qwen2.5-VL-3B shape of `tools/make_tiny_model.py --size qwen2.5-vl-3b` with its weights, at one text layer and
one vision block (`--layers 1`: the published widths and vocabulary, 446M parameters, 0.9 GB; the whole model is
7.5 GB, written on the GPU machine by GPU acceptance row 25):

- the folder is bf16 safetensors without an output layer (tied embeddings), loads with transformers as
  Qwen2_5_VLForConditionalGeneration, and its processor's image reaches the logits;
- the Megatron converter, with scripts/models/qwen2.5-vl-3b.sh's flags (--num-layers 1), turns it into the tensors
  megatron-core's model of those flags holds (shapes from the flags), and exports them back to the same tensors
  under the Hub's names (what the weight push sends SGLang).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from PIL import Image

from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.backends.megatron_utils.converters.qwen2_5_vl import split_vision_language
from slime.backends.megatron_utils.weights import read_hf_state_dict
from slime.config.arguments import parse_args
from tests.conftest import model_args


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tiny_model

    start = time.time()
    out = make_tiny_model(str(tmp_path_factory.mktemp("m") / "qwen2.5-vl-3b-l1"), arch="qwen2_5_vl",
                          size="qwen2.5-vl-3b", seed=0, layers=1)
    print(f"\n[qwen2.5-vl-3b, 1 layer] written in {time.time() - start:.1f} s on CPU")
    return out


def script_args(folder: str, tmp_path) -> object:
    tokens = model_args("qwen2.5-vl-3b")
    tokens[tokens.index("--num-layers") + 1] = "1"
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    return parse_args(["--hf-checkpoint", folder, "--prompt-data", str(data), "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "4", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
                       "--rollout-num-gpus", "1", "--train-backend", "megatron", *tokens])


def test_folder_is_bf16_tied_and_loads_with_transformers(one_layer):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    config, hf = read_hf_state_dict(one_layer)
    assert {t.dtype for t in hf.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in hf and config["tie_word_embeddings"] is True
    with open(os.path.join(one_layer, "tiny_model_info.json")) as f:
        assert json.load(f)["num_parameters"] == sum(t.numel() for t in hf.values()) == 446_160_056

    model = AutoModelForImageTextToText.from_pretrained(one_layer, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    processor = AutoProcessor.from_pretrained(one_layer, trust_remote_code=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is shown ?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    logits = []
    for colour in ("red", "blue"):
        inputs = processor(text=[text], images=[Image.new("RGB", (28, 28), colour)], return_tensors="pt")
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert logits[0].shape == (151936,) and torch.isfinite(logits[0]).all()
    assert not torch.allclose(logits[0], logits[1])  # the image reaches the logits


def test_megatron_converter_round_trip_at_the_published_widths(one_layer, tmp_path):
    args = script_args(one_layer, tmp_path)
    config, hf = read_hf_state_dict(one_layer)
    converter = converter_for_hf_config(config)
    cfg = ConverterConfig.from_args(args)
    assert cfg.tie_word_embeddings and cfg.padded_vocab_size == 151936
    mg = converter.hf_to_megatron(hf, cfg, spec="te")
    qkv = (args.num_attention_heads + 2 * args.num_query_groups) * args.kv_channels
    layer = "decoder.layers.0."
    expected = {"embedding.word_embeddings.weight": (151936, 2048),
                layer + "self_attention.linear_qkv.weight": (qkv, 2048),
                layer + "self_attention.linear_qkv.bias": (qkv,),
                layer + "self_attention.linear_proj.weight": (2048, 2048),
                layer + "mlp.linear_fc1.weight": (2 * args.ffn_hidden_size, 2048),
                layer + "mlp.linear_fc2.weight": (2048, args.ffn_hidden_size),
                "decoder.final_layernorm.weight": (2048,)}
    assert {k: tuple(mg[k].shape) for k in expected} == expected
    assert "output_layer.weight" not in mg  # tied: the embedding is the output layer
    _, vision = split_vision_language(hf)
    assert {k for k in mg if k.startswith("visual.")} == set(vision)
    exported = converter.state_dict_to_hf(mg, cfg)
    assert set(exported) == set(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
