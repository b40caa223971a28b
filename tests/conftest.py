"""Shared fixtures: the repo root on sys.path and one tiny model per test session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def model_args(script: str) -> list[str]:
    """MODEL_ARGS of a scripts/models/*.sh (a path, or a name like "tiny-qwen3"), as bash expands them."""
    if not os.path.isfile(script):
        script = os.path.join(REPO_ROOT, "scripts", "models", f"{script}.sh")
    out = subprocess.run(
        ["bash", "-c", f"set -eu; source '{script}'; printf '%s\\n' \"${{MODEL_ARGS[@]}}\""],
        capture_output=True, text=True, check=True,
    ).stdout
    return out.splitlines()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def toy_data_path(tmp_path_factory) -> str:
    from tools.make_toy_data import write_toy_data

    return write_toy_data(str(tmp_path_factory.mktemp("data") / "toy.jsonl"), num_samples=400, seed=0)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """A folder with only the tiny models' tokenizer (fast: no weights)."""
    from tools.make_tiny_model import build_tokenizer

    out = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(out)
    return out
