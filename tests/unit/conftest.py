"""Fixtures of the argument tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A fake HF folder (config.json is all the argument checks need), a prompt file, cwd = tmp_path."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    # Plugins load from cwd (which load_function puts on sys.path): undo that and forget them afterwards.
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in ("my_rm", "_slime_plugin_my_rm"):
        sys.modules.pop(name, None)
