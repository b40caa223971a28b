"""scripts/models/*.sh: each sources in bash, every flag is known to our parser and passes the Megatron
layout checks; each tiny-* script matches a freshly made tiny model's config.json."""

from __future__ import annotations

import glob
import os

import pytest

from tests.conftest import REPO_ROOT, model_args
from slime.backends.megatron_utils.config_check import find_mismatches, load_hf_config
from slime.config.arg_groups.megatron import moe_layer_pattern
from slime.config.arguments import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "models", "*.sh")))
TINY_ARCH = {  # tiny script -> tools/make_tiny_model.py --arch
    "tiny-qwen3": "qwen3", "tiny-qwen2": "qwen2", "tiny-llama": "llama", "tiny-qwen3-moe": "qwen3_moe",
    "tiny-glm4": "glm4", "tiny-glm4-moe": "glm4_moe", "tiny-deepseek-v3": "deepseek_v3",
    "tiny-qwen2.5-vl": "qwen2_5_vl", "tiny-qwen3-vl": "qwen3_vl",
}  # fmt: skip
REQUIRED_MODELS = ["glm4-9B", "glm-z1-9B", "glm4.5-106B-A12B", "glm4.5-355B-A32B", "glm4.6-355B-A32B",
                   "glm4.7-355B-A32B", "qwen3-0.6B", "qwen3-4B", "qwen3-8B", "qwen3-30B-A3B", "deepseek-v3", "deepseek-v3.1", "deepseek-r1",
                   "llama3-8B", "llama3-70B", "kimi-k2", "moonlight-16B"]  # fmt: skip


def name(script: str) -> str:
    return os.path.basename(script)[: -len(".sh")]


def argv_for(hf: str, tokens: list[str], ranks: int = 8) -> list[str]:
    return ["--hf-checkpoint", hf, "--prompt-data", "train.jsonl", "--rollout-batch-size", "32",
            "--n-samples-per-prompt", "8", "--num-rollout", "1", "--actor-num-gpus-per-node", str(ranks),
            "--rollout-num-gpus", "8", "--train-backend", "megatron", *tokens]  # fmt: skip


def test_every_listed_model_and_tiny_arch_has_a_script():
    have = {name(s) for s in SCRIPTS}
    assert set(REQUIRED_MODELS) <= have, set(REQUIRED_MODELS) - have
    assert set(TINY_ARCH) <= have, set(TINY_ARCH) - have
    from tools.make_tiny_model import ARCHS, NO_MEGATRON_ARCHS, VISION_ARCHS

    assert set(ARCHS) | set(VISION_ARCHS) == set(TINY_ARCH.values()) | set(NO_MEGATRON_ARCHS)
    assert not set(NO_MEGATRON_ARCHS) & set(TINY_ARCH.values())  # an arch with a script is built by Megatron


@pytest.mark.parametrize("script", SCRIPTS, ids=name)
def test_script_parses_with_no_unknown_flags(files, script):
    tokens = model_args(script)
    assert tokens and tokens[0].startswith("--")
    args = parse_args(argv_for("model", tokens))
    assert args.megatron_args == tokens  # every token is a Megatron flag or its value, kept in order
    assert args.num_layers and args.hidden_size and args.num_attention_heads and args.vocab_size
    assert args.position_embedding_type == ("mrope" if args.mrope_section else "rope")
    assert args.normalization == "RMSNorm" and args.swiglu
    if args.num_experts:
        assert args.moe_ffn_hidden_size and len(moe_layer_pattern(args)) == args.num_layers
    # the published sizes fit the usual 8-GPU layouts: EP 8 for MoE, TP up to 8 (whole KV heads) for dense
    if not name(script).startswith("tiny-"):
        if args.num_experts:
            extra = ["--expert-model-parallel-size", "8"]
        else:
            extra = ["--tensor-model-parallel-size", str(min(8, args.num_query_groups))]
        assert parse_args(argv_for("model", tokens + extra)).num_layers == args.num_layers


@pytest.mark.parametrize("script", [s for s in SCRIPTS if name(s) in TINY_ARCH], ids=name)
def test_tiny_script_matches_a_fresh_tiny_model(files, script, tmp_path):
    from tools.make_tiny_model import make_tiny_model

    folder = make_tiny_model(str(tmp_path / "m"), arch=TINY_ARCH[name(script)], size="tiny", seed=0)
    args = parse_args(argv_for(folder, model_args(script), ranks=1) + ["--rollout-num-gpus", "1"])
    assert find_mismatches(args, load_hf_config(folder)) == []


# The GPU launchers (the CPU main job, run-tiny-cpu.sh, makes a model first and runs end to end in CI).
LAUNCHERS = sorted(p for p in glob.glob(os.path.join(REPO_ROOT, "scripts", "run-*.sh")) if "tiny-cpu" not in p)


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=os.path.basename)
def test_launcher_flags_are_all_known(launcher, tmp_path):
    """Each GPU launcher, with train.py replaced by a recorder of its argv, passes only flags slime knows,
    with values of the right types (paths are not checked: they name files on the user's machine)."""
    import subprocess
    import sys

    from slime.config.arguments import build_parser, check_unknown_flags, split_argv

    record, recorder = tmp_path / "argv.txt", tmp_path / "recorder.py"
    recorder.write_text(f"import sys\nopen({str(record)!r}, 'w').write('\\n'.join(sys.argv[1:]))\n")
    script = tmp_path / "launcher.sh"
    script.write_text(open(launcher).read().replace(" train.py ", f" {recorder} ")
                      .replace('cd "$(dirname "$0")/.."', f"cd {REPO_ROOT}"))
    subprocess.run(["bash", str(script)], check=True, env=dict(os.environ, PYTHON=sys.executable), timeout=60)
    argv = record.read_text().splitlines()
    parser = build_parser()
    split = split_argv(parser, argv)
    check_unknown_flags(parser, split.unknown)
    args = parser.parse_args(split.known)
    assert args.train_backend == "megatron" and args.num_layers
