"""Write a tiny, random-init Hugging Face model folder with no network access.

The folder holds config.json, model.safetensors, generation_config.json and a word-level tokenizer
(tokenizer.json + tokenizer_config.json with a Qwen-style chat template). The architecture is a real
transformers one (Qwen3 by default; also qwen2, llama, qwen3_moe, glm4, glm4_moe, deepseek_v3 for the
HF<->Megatron converter tests) at a tiny size; `qwen2_5_vl` is a vision-language model (Qwen2.5-VL: a tiny
ViT of 2 blocks with patch 14 and 2x2 merging, mrope text model) whose folder also holds its processor
(preprocessor_config.json + processor chat template; the tokenizer gains Qwen's vision tokens
<|vision_start|> <|image_pad|> <|vision_end|> <|video_pad|> and a few image words), loadable with
`AutoProcessor.from_pretrained` offline. `qwen3_vl` is Qwen3-VL (dense): a Qwen3 text model (q/k norm) with
interleaved mrope, a ViT with patch 16, 2x2 merging and deepstack features from both of its blocks, the same vision
tokens and chat template. Their images are resized to 1..4 merged patches (at most 4 image tokens), and they have no
video processor (that one needs torchvision); everything is deterministic from --seed. Each text arch has a
matching `scripts/models/tiny-<arch>.sh` with its Megatron flags (for --size tiny).

`--size qwen2.5-vl-3b` (with `--arch qwen2_5_vl`) is Qwen2.5-VL-3B-Instruct's published shape, random init, for runs
at the real size on a GPU machine: 3.75B parameters in bf16 (7.5 GB), initialised on `--device` (`cuda` there: a
CPU init of that size takes minutes); the same tokenizer and processor as the tiny VLM (the config's vocabulary,
151936, exceeds the tokenizer's; the vision tokens' ids are the tokenizer's). Its Megatron flags:
scripts/models/qwen2.5-vl-3b.sh. `--layers N` keeps the widths with N text layers and N vision blocks (a quick
check of the shape on CPU).

`build_tokenizer(out, chat_template=...)` can instead write a tokenizer with a Qwen3, GLM-4 or Llama-3 style
chat template (CHAT_TEMPLATES; their special tokens are appended to the vocabulary) for tests of
chat-template-dependent code; the default is unchanged.

Simplifications: the tokenizer is word-level over a small fixed English vocabulary plus single digits
(unknown words map to <unk>; text is lower-cased), which is what the toy tasks under examples/ and tools/ need; it is not a
BPE tokenizer and cannot round-trip arbitrary text.

    python tools/make_tiny_model.py --out models/tiny-qwen3 --size tiny --seed 0
    python tools/make_tiny_model.py --out models/qwen2.5-vl-3b-random --arch qwen2_5_vl --size qwen2.5-vl-3b --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
PUNCTUATION = list(".,:;?!+-*/=()[]{}<>'\"#_%$&@^|~`\\")
WORDS = """
system user assistant tool
what which who how many much is are was be the a an of to in on at for from by with and or not no yes
number numbers digit digits comes after before next previous plus minus times equals sum answer
say reply repeat copy count add subtract multiply result question solve find give write output
color colour red green blue yellow black white orange purple pink brown gray
animal cat dog bird fish cow horse sheep mouse lion tiger
one two three four five six seven eight nine ten zero
first second third last word words letter letters only please then this that it its
true false correct wrong call search query results result information
you are helpful math tutor think step boxed
""".split()
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Chat templates of other model families, for tests of chat-template-dependent code (loss masks,
# multi-turn tool messages). Written from each family's published format, kept minimal: no tool schemas
# in the system prompt beyond a list, no date/tool-call JSON formatting beyond what the layout needs.
# Extra special tokens each family needs are appended to the vocabulary (after the default one).
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'user' or m['role'] == 'system' %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- set content = m['content'] or '' %}"
    "{%- set reasoning = m['reasoning_content'] or '' if m['reasoning_content'] is defined else '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
GLM4_CHAT_TEMPLATE = (
    "{{- '[gMASK]<sop>' }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|observation|>' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{%- else %}"
    "{{- '<|' + m['role'] + '|>\n' + (m['content'] or '') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + (m['content'] or '') | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# Qwen2.5-VL's layout: an image content part renders as <|vision_start|><|image_pad|><|vision_end|>, which the
# processor then expands to one <|image_pad|> per merged image patch.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_INNER_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_end|>"]  # decoded with no space before them
# words of the toy visual tasks, in the vision tokenizer only (the text models' vocabulary stays as it was)
VISION_WORDS = "image picture fills fill shown shows colours colors".split()
CHAT_TEMPLATES = {
    # family: (template, extra special tokens, eos token)
    "default": (CHAT_TEMPLATE, [], "<|im_end|>"),
    "qwen3": (QWEN3_CHAT_TEMPLATE, [], "<|im_end|>"),
    "glm4": (GLM4_CHAT_TEMPLATE, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
             "<|endoftext|>"),
    "llama3": (LLAMA3_CHAT_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                      "<|eom_id|>"], "<|eot_id|>"),
    "qwen2_5_vl": (QWEN2_5_VL_CHAT_TEMPLATE, VISION_TOKENS, "<|im_end|>"),
    # Qwen3-VL marks an image with the same three tokens as Qwen2.5-VL
    "qwen3_vl": (QWEN2_5_VL_CHAT_TEMPLATE, VISION_TOKENS, "<|im_end|>"),
}

SIZES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate); "tiny" ~1M, "small" ~20M parameters
    "tiny": (128, 4, 4, 2, 32, 512),
    "small": (384, 8, 6, 2, 64, 1536),
    "qwen2.5-vl-3b": (2048, 36, 16, 2, 128, 11008),  # the text model of PUBLISHED["qwen2.5-vl-3b"]
}
# Sizes that are a real checkpoint's published shape (random init, bf16): what differs from the tiny sizes besides
# SIZES. Qwen2.5-VL-3B-Instruct: the Hub's config.json (huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct, transformers
# 4.49 layout); its vision_config names hidden_size 1280, out_hidden_size 2048, patch 14 and tokens_per_second 2,
# the rest (depth 32, 16 heads, intermediate 3420, 2x2 merge, temporal patch 2, window 112, full attention in
# blocks 7/15/23/31) are transformers' Qwen2_5_VLVisionConfig defaults, which the checkpoint relies on.
PUBLISHED = {
    "qwen2.5-vl-3b": dict(arch="qwen2_5_vl", vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=128000,
                          vision=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)),
}
# MoE / MLA sizes of the non-dense archs: (experts, top-k, expert ffn, shared-expert ffn) and
# (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
MOE = (4, 2, 64, 64)
MLA = (64, 32, 16, 8, 16)
ARCHS = ["qwen3", "qwen2", "llama", "qwen3_moe", "glm4", "glm4_moe", "deepseek_v3"]
# vision-language archs (their Megatron scripts: scripts/models/tiny-qwen2.5-vl.sh, tiny-qwen3-vl.sh, the language
# model only)
VISION_ARCHS = ["qwen2_5_vl", "qwen3_vl"]
# archs the Megatron backend does not build (it refuses them before Ray starts): no scripts/models/*.sh of theirs;
# they run on the fsdp trainer and the hf engine
NO_MEGATRON_ARCHS: list[str] = []
# tiny vision tower: (depth, hidden, heads, intermediate); 2x2 merge as the real ones
VISION = (2, 32, 2, 64)
# each arch's ViT patch size: images are resized to between 1 and 4 merged patches (2 x patch pixels square), so
# at most 4 image tokens on CPU
PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}


def build_vocab() -> list[str]:
    vocab: list[str] = []
    for tok in SPECIAL_TOKENS + [str(d) for d in range(10)] + PUNCTUATION + WORDS:
        if tok not in vocab:
            vocab.append(tok)
    return vocab


def build_tokenizer(out: str, chat_template: str = "default"):
    """The word-level tokenizer, saved to `out`. `chat_template` picks a family from CHAT_TEMPLATES
    ("default": the Qwen-style template of the tiny models; others append their special tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template {chat_template!r}: choose one of {sorted(CHAT_TEMPLATES)}")
    template, extra_special, eos = CHAT_TEMPLATES[chat_template]
    special = SPECIAL_TOKENS + extra_special
    vocab = build_vocab() + extra_special
    vision = chat_template in VISION_ARCHS
    if vision:
        vocab += [w for w in VISION_WORDS if w not in vocab]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    if vision:
        # decoded as a real Qwen tokenizer decodes an image's tokens: `<|vision_start|><|image_pad|>...<|vision_end|>`
        # with no space inside, which SGLang's Qwen-VL processor matches to find the images of ids it is sent
        tok.decoder = decoders.Sequence([tok.decoder] + [decoders.Replace(" " + t, t) for t in VISION_INNER_TOKENS])
    tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=[t for t in special if t not in ("<|endoftext|>", eos, "<unk>")],
    )
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def build_config(arch: str, size: str, vocab_size: int, tokenizer, layers: int | None = None):
    """The arch's transformers config at `size` (`layers`: that many text layers, and vision blocks, instead)."""
    hidden, size_layers, heads, kv_heads, head_dim, inter = SIZES[size]
    published = PUBLISHED.get(size, {})
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers or size_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=published.get("max_position_embeddings", 2048),
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=published.get("tie_word_embeddings", False),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        initializer_range=0.02,
    )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(head_dim=head_dim, **common)
    experts, topk, moe_ffn, shared_ffn = MOE
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)  # Qwen2 has no head_dim field: hidden / heads (= 32 at tiny)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # every layer MoE, as Qwen3-MoE releases are (and as SGLang builds them: it reads no mlp_only_layers);
        # dense layers beside MoE ones come with glm4_moe / deepseek_v3 (first_k_dense_replace)
        return Qwen3MoeConfig(head_dim=head_dim, num_experts=experts, num_experts_per_tok=topk,
                              moe_intermediate_size=moe_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True, **common)  # fmt: skip
    if arch == "glm4":
        from transformers import Glm4Config

        return Glm4Config(head_dim=head_dim, attention_bias=True, partial_rotary_factor=0.5, **common)
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(head_dim=head_dim, attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=True,
                             n_routed_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_ffn,
                             n_shared_experts=shared_ffn // moe_ffn, first_k_dense_replace=1, n_group=1,
                             topk_group=1, routed_scaling_factor=1.0, **common)  # fmt: skip
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        q_lora, kv_lora, nope, rope, v = MLA
        common = {**common, "num_key_value_heads": heads}  # MLA: one latent shared by all heads
        return DeepseekV3Config(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                                qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=experts,
                                num_experts_per_tok=topk, moe_intermediate_size=moe_ffn,
                                n_shared_experts=shared_ffn // moe_ffn, first_k_dense_replace=1, n_group=1,
                                topk_group=1, routed_scaling_factor=1.0, **common)  # fmt: skip
    if arch == "qwen2_5_vl":
        return _qwen2_5_vl_config(common, head_dim, tokenizer, published.get("vision"), layers)
    if arch == "qwen3_vl":
        return _qwen3_vl_config(common, head_dim, tokenizer)
    raise ValueError(f"--arch {arch}: supported architectures are {', '.join(ARCHS + VISION_ARCHS)}")


def _qwen2_5_vl_config(common: dict, head_dim: int, tokenizer, published_vision: dict | None = None,
                       layers: int | None = None):
    """Qwen2.5-VL: a Qwen2 text model with multimodal RoPE (mrope sections summing to head_dim / 2: [16, 24, 24] at
    head_dim 128, as published) and a windowed-attention ViT whose blocks in `fullatt_block_indexes` attend
    globally (the tiny one's last block; with `layers`, those below it, else the last)."""
    from transformers import Qwen2_5_VLConfig

    depth, v_hidden, v_heads, v_inter = VISION
    vision = dict(depth=depth, hidden_size=v_hidden, num_heads=v_heads, intermediate_size=v_inter,
                  fullatt_block_indexes=[depth - 1])
    vision.update(published_vision or {})
    if layers:
        vision["depth"] = layers
        vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < layers] or [layers - 1]
    half = head_dim // 2
    temporal = half // 4
    sections = [temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2]
    text = {k: v for k, v in common.items() if k not in ("rope_theta", "tie_word_embeddings")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": common["rope_theta"], "mrope_section": sections}
    vision.update(out_hidden_size=common["hidden_size"], patch_size=PATCH_SIZE["qwen2_5_vl"], spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, initializer_range=0.02)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"],
                            **_vision_token_ids(tokenizer))


def _vision_token_ids(tokenizer) -> dict:
    return {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
            [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
             ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}


def _qwen3_vl_config(common: dict, head_dim: int, tokenizer):
    """Qwen3-VL (dense): a Qwen3 text model (q/k norm) with interleaved multimodal RoPE (sections summing to
    head_dim / 2, as [24, 20, 20] for the real head_dim 128) and a ViT with learned position embeddings whose blocks
    in `deepstack_visual_indexes` feed extra features into the first text layers (every block here: 2 of 4)."""
    from transformers import Qwen3VLConfig

    depth, v_hidden, v_heads, v_inter = VISION
    half = head_dim // 2
    spatial = (half * 5 // 16)
    sections = [half - 2 * spatial, spatial, spatial]
    text = {k: v for k, v in common.items() if k not in ("rope_theta", "tie_word_embeddings")}
    text["head_dim"] = head_dim
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": common["rope_theta"], "mrope_section": sections,
                               "mrope_interleaved": True}
    vision = dict(depth=depth, hidden_size=v_hidden, num_heads=v_heads, intermediate_size=v_inter,
                  out_hidden_size=common["hidden_size"], patch_size=PATCH_SIZE["qwen3_vl"], spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=list(range(depth)),
                  initializer_range=0.02)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         **_vision_token_ids(tokenizer))


# the processor class of each vision arch, in tools/tiny_vlm/processing_tiny_vl.py (copied into its folder)
PROCESSOR_MODULE = "processing_tiny_vl"
PROCESSORS = {"qwen2_5_vl": "TinyQwen2_5_VLProcessor", "qwen3_vl": "TinyQwen3VLProcessor"}


def build_processor(out: str, arch: str = "qwen2_5_vl") -> None:
    """The arch's image processor config (preprocessor_config.json: Qwen2-VL's image processor with its patch size)
    and the folder's processor class (tools/tiny_vlm/processing_tiny_vl.py, its class named in processor_config.json's
    auto_map: the stock Qwen2.5-VL / Qwen3-VL processors cannot be built without torchvision, which their video
    processors need)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * PATCH_SIZE[arch]  # one merged patch
    # Qwen3-VL normalises with mean = std = 0.5 (its checkpoints' preprocessor_config.json); Qwen2.5-VL with CLIP's
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if arch == "qwen3_vl" else {}
    Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=4 * side * side, patch_size=PATCH_SIZE[arch],
                             merge_size=2, temporal_patch_size=2, **norm).save_pretrained(out)
    cls = PROCESSORS[arch]
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_vlm", PROCESSOR_MODULE + ".py"), out)
    auto = {"AutoProcessor": f"{PROCESSOR_MODULE}.{cls}"}
    with open(os.path.join(out, "processor_config.json"), "w") as f:
        json.dump({"processor_class": cls, "auto_map": auto}, f, indent=2)
    # AutoProcessor reads auto_map from the image processor config too
    path = os.path.join(out, "preprocessor_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "auto_map": auto}, f, indent=2)


def write_config(out: str, arch: str = "qwen3", size: str = "tiny", layers: int | None = None):
    """The folder without weights: tokenizer, processor (vision archs) and config.json; returns the config."""
    if size not in SIZES:
        raise ValueError(f"--size {size}: choose one of {sorted(SIZES)}")
    if size in PUBLISHED and arch != PUBLISHED[size]["arch"]:
        raise ValueError(f"--size {size} is the published shape of a {PUBLISHED[size]['arch']} model; pass "
                         f"--arch {PUBLISHED[size]['arch']} (not {arch})")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers {layers}: give at least 1")
    os.makedirs(out, exist_ok=True)
    vision = arch in VISION_ARCHS
    tokenizer = build_tokenizer(out, chat_template=arch if vision else "default")
    if vision:
        build_processor(out, arch)
    vocab_size = PUBLISHED.get(size, {}).get("vocab_size") or ((len(tokenizer) + 63) // 64) * 64
    config = build_config(arch, size, vocab_size, tokenizer, layers)
    config.save_pretrained(out)
    return config


def make_tiny_model(out: str, arch: str = "qwen3", size: str = "tiny", seed: int = 0, layers: int | None = None,
                    device: str = "cpu") -> str:
    """The whole folder (write_config's and random weights). A published size is initialised and written in bf16
    (its checkpoint's dtype), the tiny ones in fp32; `device` is where the weights are initialised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    config = write_config(out, arch, size, layers)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch in VISION_ARCHS else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(config, dtype=torch.bfloat16 if size in PUBLISHED else torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    text_config = config.get_text_config()
    GenerationConfig(
        eos_token_id=[text_config.eos_token_id, text_config.pad_token_id], pad_token_id=text_config.pad_token_id
    ).save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    with open(os.path.join(out, "tiny_model_info.json"), "w") as f:
        json.dump({"arch": arch, "size": size, "seed": seed, "num_parameters": n_params,
                   **({"layers": layers} if layers else {})}, f, indent=2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--arch", default="qwen3", choices=ARCHS + VISION_ARCHS)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None,
                        help="this many text layers and vision blocks instead of the size's (the widths stay)")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda for a published size)")
    args = parser.parse_args()
    make_tiny_model(args.out, args.arch, args.size, args.seed, args.layers, args.device)
    with open(os.path.join(args.out, "tiny_model_info.json")) as f:
        print(f"wrote {args.out}: {json.load(f)}")


if __name__ == "__main__":
    main()
