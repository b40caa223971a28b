"""The Megatron backend's vision-language pieces that need no megatron-core: 3-D (mrope) position ids against
transformers' Qwen2.5-VL / Qwen3-VL `get_rope_index`, Qwen3-VL's interleaved multimodal RoPE angles against
transformers', the Qwen2.5-VL / Qwen3-VL converters' names (language model through the Qwen2 / Qwen3 mapping, the
vision tower under its HF names), Qwen3-VL's deepstack layout checks, and other vision-language models refused at
validation."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron_utils.converters import ConverterConfig, converter_for_hf_config
from slime.backends.megatron_utils.converters.qwen2_5_vl import split_vision_language
from slime.backends.megatron_utils.vision_language import mrope_position_ids
from slime.utils.errors import SlimeArgumentError

IMAGE = 9


def _image(grid: tuple[int, int, int], merge: int = 2) -> list[int]:
    t, h, w = grid
    return [7] + [IMAGE] * (t * h * w // merge ** 2) + [8]  # vision start, image tokens, vision end


def test_text_rows_count_on_all_three_axes():
    ids = torch.tensor([[1, 2, 3, 4]])
    assert mrope_position_ids(ids, None, ids == IMAGE, 2).tolist() == [[[0, 1, 2, 3]]] * 3


def test_an_image_spreads_over_height_and_width_and_text_continues_after_its_largest_side():
    # grid (1, 4, 6) merged 2x2: 2 rows x 3 columns of tokens, starting at position 2 (after "1 <start>")
    ids = torch.tensor([[1, *_image((1, 4, 6)), 5]])
    pos = mrope_position_ids(ids, torch.tensor([[1, 4, 6]]), ids == IMAGE, 2)[:, 0].tolist()
    assert pos[0] == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]
    assert pos[1] == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
    assert pos[2] == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]


def test_positions_equal_transformers_get_rope_index():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 64, "vocab_size": 16,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 32},
        image_token_id=IMAGE, vision_start_token_id=7, vision_end_token_id=8)
    model = Qwen2_5_VLModel(config)
    rows = [[1, 2, *_image((1, 4, 4)), 3, *_image((1, 2, 6)), 4, 5], [1, *_image((2, 6, 2)), 3], [1, 2, 3, 4]]
    grids = torch.tensor([[1, 4, 4], [1, 2, 6], [2, 6, 2]])
    for row, row_grids in zip(rows, [grids[:2], grids[2:], None]):
        ids = torch.tensor([row])
        theirs = (model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=row_grids)[0]
                  if row_grids is not None else torch.arange(len(row)).expand(3, 1, -1))
        assert torch.equal(mrope_position_ids(ids, row_grids, ids == IMAGE, 2), theirs)
    # the rows as one right-padded batch, images in row order: each real token's positions as alone
    length = max(map(len, rows))
    batch = torch.tensor([r + [0] * (length - len(r)) for r in rows])
    together = mrope_position_ids(batch, grids, batch == IMAGE, 2)
    for i, row in enumerate(rows):
        alone = torch.tensor([row])
        row_grids = [grids[:2], grids[2:], None][i]
        assert torch.equal(together[:, i, :len(row)], mrope_position_ids(alone, row_grids, alone == IMAGE, 2)[:, 0])


def test_image_tokens_and_grids_that_disagree_are_errors():
    ids = torch.tensor([[1, *_image((1, 4, 4)), 2]])
    with pytest.raises(ValueError, match="more image tokens"):
        mrope_position_ids(ids, torch.zeros(0, 3, dtype=torch.long), ids == IMAGE, 2)
    with pytest.raises(ValueError, match="not as many image tokens follow"):
        mrope_position_ids(ids, torch.tensor([[1, 4, 6]]), ids == IMAGE, 2)
    with pytest.raises(ValueError, match="describes 2 image"):
        mrope_position_ids(ids, torch.tensor([[1, 4, 4], [1, 2, 2]]), ids == IMAGE, 2)


def _qwen2_5_vl_checkpoint(language_prefix: str, vision_prefix: str) -> tuple[dict, dict]:
    hidden, heads, groups, inter, vocab = 8, 2, 1, 16, 12
    head = hidden // heads
    torch.manual_seed(0)
    sd = {f"{language_prefix}embed_tokens.weight": torch.randn(vocab, hidden),
          f"{language_prefix}norm.weight": torch.randn(hidden), "lm_head.weight": torch.randn(vocab, hidden),
          f"{vision_prefix}patch_embed.proj.weight": torch.randn(4, 3, 2, 2, 2),
          f"{vision_prefix}blocks.0.attn.qkv.weight": torch.randn(12, 4)}
    p = f"{language_prefix}layers.0."
    q, kv = heads * head, groups * head
    for name, shape in [("self_attn.q_proj.weight", (q, hidden)), ("self_attn.q_proj.bias", (q,)),
                        ("self_attn.k_proj.weight", (kv, hidden)), ("self_attn.k_proj.bias", (kv,)),
                        ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.v_proj.bias", (kv,)),
                        ("self_attn.o_proj.weight", (hidden, hidden)), ("input_layernorm.weight", (hidden,)),
                        ("post_attention_layernorm.weight", (hidden,)), ("mlp.gate_proj.weight", (inter, hidden)),
                        ("mlp.up_proj.weight", (inter, hidden)), ("mlp.down_proj.weight", (hidden, inter))]:
        sd[p + name] = torch.randn(shape)
    cfg = ConverterConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                          head_dim=head, vocab_size=vocab, padded_vocab_size=16)
    return sd, cfg


@pytest.mark.parametrize("language_prefix,vision_prefix", [("model.", "visual."),
                                                           ("model.language_model.", "model.visual.")],
                         ids=["hub_files", "transformers_in_memory"])
def test_converter_loads_both_spellings_and_exports_the_hub_names(language_prefix, vision_prefix):
    hf, cfg = _qwen2_5_vl_checkpoint(language_prefix, vision_prefix)
    conv = converter_for_hf_config({"model_type": "qwen2_5_vl"})
    mg = conv.hf_to_megatron(hf, cfg, spec="local")
    assert torch.equal(mg["visual.blocks.0.attn.qkv.weight"], hf[f"{vision_prefix}blocks.0.attn.qkv.weight"])
    assert mg["embedding.word_embeddings.weight"].shape == (16, 8)  # padded vocabulary
    assert mg["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (16,)  # Qwen2's QKV bias, fused
    exported = conv.state_dict_to_hf(mg, cfg)
    language, vision = split_vision_language(hf)
    hub = {**language, **vision}  # the Hub's spelling: model.*, visual.*, lm_head.weight
    assert set(exported) == set(hub)
    assert all(torch.equal(exported[k], hub[k]) for k in hub)


def test_packed_micro_batch_inputs_restart_per_sequence_and_leave_sampled_image_tokens_as_text():
    from slime.backends.megatron_utils.vision_language import VisionSpec, micro_batch_inputs
    from slime.backends.training.batching import make_micro_batch, make_packed_micro_batch

    first = [1, *_image((1, 4, 4)), 3, 4, IMAGE]  # the response (last 2 tokens) sampled an image token
    second = [1, 2, 5]
    grid = torch.tensor([[1, 4, 4]])
    per_row = [{"pixel_values": torch.zeros(16, 6), "image_grid_thw": grid}, None]
    spec = VisionSpec("qwen2_5_vl", None, IMAGE, 2, 7, 8)
    packed = micro_batch_inputs(make_packed_micro_batch([first, second], [2, 1], multiple=4), per_row, [0, 1], spec)
    alone = mrope_position_ids(torch.tensor([first[:-1]]), grid, torch.tensor([first[:-1]]) == IMAGE, 2)[:, 0]
    positions = packed["position_ids"][:, 0]
    assert torch.equal(positions[:, : len(first) - 1], alone)
    assert positions[:, len(first) - 1].tolist() == [int(alone[0, -1]) + 1] * 3  # the sampled image token: text
    assert positions[:, len(first): len(first) + 3].tolist() == [[0, 1, 2]] * 3  # the next sequence restarts
    assert packed["image_mask"].sum() == 4 and not bool(packed["image_mask"][0, len(first) - 1])
    assert packed["pixel_values"].shape == (16, 6) and torch.equal(packed["image_grid_thw"], grid)
    padded = micro_batch_inputs(make_micro_batch([second, first], [1, 2]), per_row[::-1], [0, 1], spec)
    assert padded["position_ids"].shape == (3, 2, len(first)) and int(padded["image_mask"][1].sum()) == 4
    text_only = micro_batch_inputs(make_micro_batch([second], [1]), [None], [0], spec)
    assert set(text_only) == {"position_ids"} and text_only["position_ids"][:, 0].tolist() == [[0, 1, 2]] * 3


def test_an_observation_image_in_the_response_takes_features():
    """A multi-turn rollout's observation image (a marked run in the response region) holds its image, as the
    engine and the fsdp trainer place it (slime.utils.image_tokens)."""
    from slime.backends.megatron_utils.vision_language import VisionSpec, micro_batch_inputs
    from slime.backends.training.batching import make_micro_batch

    row = [1, *_image((1, 4, 4)), 3, *_image((1, 2, 2)), 5, IMAGE]  # response: from the 3; the last token sampled
    grids = torch.tensor([[1, 4, 4], [1, 2, 2]])
    per_row = [{"pixel_values": torch.zeros(20, 6), "image_grid_thw": grids}]
    spec = VisionSpec("qwen2_5_vl", None, IMAGE, 2, 7, 8)
    out = micro_batch_inputs(make_micro_batch([row], [7]), per_row, [0], spec)
    assert out["image_mask"][0].tolist() == [t == IMAGE for t in row[:-1]] + [False]
    with pytest.raises(ValueError, match="micro-batch sequence 0"):  # an image whose run is not there
        wrong = torch.tensor([[1, 4, 4], [1, 4, 4]])
        micro_batch_inputs(make_micro_batch([row], [7]), [{"pixel_values": torch.zeros(32, 6),
                                                          "image_grid_thw": wrong}], [0], spec)


def test_a_vision_language_model_without_a_megatron_tower_is_refused_before_ray_starts(tmp_path):
    """A vision-language --hf-checkpoint whose tower this backend does not build (here a LLaVA config) with
    --train-backend megatron: refused by argument validation (naming the model type, the types built and the fix),
    before the MODEL_ARGS cross-check would ask for flags that could not help."""
    import json

    from tests.args import make_args

    folder = tmp_path / "llava"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava",
                                                    "architectures": ["LlavaForConditionalGeneration"],
                                                    "vision_config": {"model_type": "clip_vision_model"}}))
    with pytest.raises(SlimeArgumentError) as e:
        make_args("--train-backend", "megatron", "--num-layers", "4", "--hidden-size", "128",
                  "--num-attention-heads", "4", hf_checkpoint=str(folder))
    message = str(e.value)
    assert "'llava'" in message and "LlavaForConditionalGeneration" in message
    assert "['qwen2_5_vl', 'qwen3_vl']" in message and "use --train-backend fsdp" in message
    assert str(folder) in message


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("q3vl") / "qwen3_vl"), arch="qwen3_vl", size="tiny", seed=0)


def test_qwen3_vl_is_taken_by_the_megatron_backend_with_its_script(tiny_qwen3_vl):
    from tests.args import make_args
    from tests.conftest import model_args

    args = make_args("--train-backend", "megatron", *model_args("tiny-qwen3-vl"), hf_checkpoint=tiny_qwen3_vl)
    assert args.mrope_section == [6, 5, 5] and args.qk_layernorm


@pytest.mark.parametrize("flags,needle", [
    (["--pipeline-model-parallel-size", "4"], "--decoder-first-pipeline-num-layers >= 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--decoder-first-pipeline-num-layers >= 2"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "--recompute-granularity full"),
], ids=["pp4", "vpp1", "full_recompute"])
def test_qwen3_vl_deepstack_layers_off_the_first_stage_or_recomputed_whole_are_refused(tiny_qwen3_vl, flags, needle):
    """The tiny Qwen3-VL adds deepstack features to its first 2 layers: a first pipeline chunk of 1 layer, or
    layers recomputed whole, are refused at validation, naming the flag; PP 2 (2 layers a stage) is taken."""
    from tests.args import make_args
    from tests.conftest import model_args

    base = ["--train-backend", "megatron", *model_args("tiny-qwen3-vl"), "--actor-num-gpus-per-node", "4"]
    with pytest.raises(SlimeArgumentError, match="deepstack") as e:
        make_args(*base, *flags, hf_checkpoint=tiny_qwen3_vl)
    assert needle in str(e.value)
    assert make_args(*base, "--pipeline-model-parallel-size", "2",
                     hf_checkpoint=tiny_qwen3_vl).pipeline_model_parallel_size == 2


def test_interleaved_mrope_angles_equal_transformers_qwen3_vl():
    """Qwen3-VL's text rotary embedding (transformers) takes the height / width positions at every third
    frequency; our angles give the same cos / sin for 3-D positions whose axes all differ."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from slime.backends.megatron_utils.vision_language import interleaved_mrope_freqs

    section = [6, 5, 5]
    config = Qwen3VLTextConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section,
                                                "mrope_interleaved": True})
    rotary = Qwen3VLTextRotaryEmbedding(config)
    torch.manual_seed(0)
    positions = torch.randint(0, 50, (3, 2, 7))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [B, L, 32]
    angles = interleaved_mrope_freqs(positions, rotary.inv_freq, section)  # [L, B, 1, 32]
    assert angles.shape == (7, 2, 1, 32)
    ours = angles[:, :, 0].transpose(0, 1)
    assert torch.allclose(ours.cos(), cos, atol=1e-6) and torch.allclose(ours.sin(), sin, atol=1e-6)
    # the blocked layout (Qwen2.5-VL's) differs on the same positions
    blocked = torch.cat([positions[i % 3, ..., None].float() * f for i, f in
                         enumerate(rotary.inv_freq.split(section))], dim=-1)
    assert not torch.allclose(torch.cat([blocked, blocked], -1).cos(), cos, atol=1e-3)


def test_qwen3_vl_positions_equal_transformers_get_rope_index(tiny_qwen3_vl):
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    config = AutoConfig.from_pretrained(tiny_qwen3_vl)
    model = Qwen3VLModel(config)
    token, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    image = lambda grid: [start] + [token] * (grid[0] * grid[1] * grid[2] // 4) + [end]  # noqa: E731
    row = [1, 2, *image((1, 4, 4)), 3, *image((1, 2, 6)), 4, 5]
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])
    ids = torch.tensor([row])
    theirs = model.get_rope_index(ids, mm_token_type_ids=(ids == token).int(), image_grid_thw=grids)[0]
    assert torch.equal(mrope_position_ids(ids, grids, ids == token, 2), theirs)


def _qwen3_vl_checkpoint() -> tuple[dict, dict]:
    hidden, heads, groups, inter, vocab = 8, 2, 1, 16, 12
    head = hidden // heads
    torch.manual_seed(0)
    lm, vis = "model.language_model.", "model.visual."
    sd = {f"{lm}embed_tokens.weight": torch.randn(vocab, hidden), f"{lm}norm.weight": torch.randn(hidden),
          "lm_head.weight": torch.randn(vocab, hidden), f"{vis}patch_embed.proj.weight": torch.randn(4, 3, 2, 2, 2),
          f"{vis}deepstack_merger_list.0.linear_fc1.weight": torch.randn(8, 8)}
    p = f"{lm}layers.0."
    q, kv = heads * head, groups * head
    for name, shape in [("self_attn.q_proj.weight", (q, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
                        ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.q_norm.weight", (head,)),
                        ("self_attn.k_norm.weight", (head,)), ("self_attn.o_proj.weight", (hidden, hidden)),
                        ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
                        ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                        ("mlp.down_proj.weight", (hidden, inter))]:
        sd[p + name] = torch.randn(shape)
    cfg = ConverterConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                          head_dim=head, vocab_size=vocab, padded_vocab_size=16)
    return sd, cfg


@pytest.mark.parametrize("spelling", ["checkpoint", "qwen2_5_vl_style"])
def test_qwen3_vl_converter_loads_and_exports_the_checkpoint_names(spelling):
    """The Hub's Qwen3-VL files name the parts `model.language_model.*` / `model.visual.*`: loaded (q/k norms
    included; also the `model.*` / `visual.*` spelling) and exported back under exactly those names."""
    hf, cfg = _qwen3_vl_checkpoint()
    source = hf
    if spelling == "qwen2_5_vl_style":
        language, vision = split_vision_language(hf)
        source = {**language, **vision}
    conv = converter_for_hf_config({"model_type": "qwen3_vl"})
    mg = conv.hf_to_megatron(source, cfg, spec="local")
    assert torch.equal(mg["visual.deepstack_merger_list.0.linear_fc1.weight"],
                       hf["model.visual.deepstack_merger_list.0.linear_fc1.weight"])
    assert torch.equal(mg["decoder.layers.0.self_attention.q_layernorm.weight"],
                       hf["model.language_model.layers.0.self_attn.q_norm.weight"])
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in mg
    exported = conv.state_dict_to_hf({"module." + k if k.startswith("visual.") else k: v for k, v in mg.items()},
                                     cfg)
    assert set(exported) == set(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
