"""`ifbench`: the metadata -> checker wiring, IFBench's strict rule, and the errors without the IFBench package.

IFBench (`pip install git+https://github.com/allenai/IFBench`) is not installable on the CPU test machines, so the
end-to-end test puts a two-checker `ifbench` package of its own on sys.path: it has IFBench's interface
(`INSTRUCTION_DICT`, checkers with `build_description` / `get_instruction_args` / `check_following`) and tests our
side of it only.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from slime.rollout.rm_hub import validate_rm_type
from slime.rollout.rm_hub.ifbench import (
    _coerce_kwargs_list,
    _normalize_instruction_ids,
    compute_ifbench_reward,
    follows_all_instructions,
)
from slime.utils.errors import SlimeArgumentError
from tests.args import make_args

IFBENCH_INSTALLED = importlib.util.find_spec("ifbench") is not None


class _Contains:
    """Follows when the response contains `word` (and, when built with a prompt, the prompt's first word)."""

    built: list[dict] = []
    checked: list[str] = []

    def __init__(self, instruction_id):
        self.id, self.word, self.prompt = instruction_id, None, None

    def build_description(self, **kwargs):
        _Contains.built.append(kwargs)
        self.word = kwargs.get("word", self.word)
        self.prompt = kwargs.get("prompt", self.prompt)

    def get_instruction_args(self):
        return {"word": self.word, "prompt": self.prompt}

    def check_following(self, value):
        _Contains.checked.append(self.id)
        first = self.prompt.split()[0] if self.prompt else ""
        return self.word in value and first in value


REGISTRY = {"keywords:contains": _Contains, "keywords:also": _Contains}


def test_instruction_ids_and_kwargs_are_normalised():
    assert _normalize_instruction_ids([" keywords:contains ", None, "  ", 7]) == ["keywords:contains", "7"]
    assert _normalize_instruction_ids(None) == []
    # one dict per instruction: a short list repeats its last entry, a long one is cut, None values dropped
    assert _coerce_kwargs_list([{"n": 1}, {"n": None, "m": 2}], 3) == [{"n": 1}, {"m": 2}, {"m": 2}]
    assert _coerce_kwargs_list([{"n": 1}, {"n": 2}], 1) == [{"n": 1}]
    assert _coerce_kwargs_list({"n": 1}, 2) == [{"n": 1}, {"n": 1}]
    assert _coerce_kwargs_list(["junk", None], 2) == [{}, {}]
    assert _coerce_kwargs_list(None, 2) == [{}, {}]


def test_strict_rule():
    _Contains.built.clear()
    _Contains.checked.clear()
    ids = ["keywords:contains", "keywords:also"]
    kwargs = [{"word": "cat"}, {"word": "dog"}]
    assert follows_all_instructions(REGISTRY, ids, kwargs, "Write a poem", "Write: cat and dog") is True
    # built from the kwargs, then again with the prompt since the checker takes one
    assert _Contains.built[:2] == [{"word": "cat"}, {"prompt": "Write a poem"}]
    _Contains.checked.clear()
    assert follows_all_instructions(REGISTRY, ids, kwargs, "Write a poem", "Write: a dog") is False
    assert _Contains.checked == ids  # every checker runs, as in IFBench
    assert follows_all_instructions(REGISTRY, ids, kwargs, "", "   ") is False  # a blank response follows nothing
    with pytest.raises(ValueError, match="unknown instruction id 'nope:x'.*knows 2 ids"):
        follows_all_instructions(REGISTRY, ["nope:x"], [{}], "", "text")


def test_no_instructions_score_zero_without_the_package():
    assert compute_ifbench_reward("text", None, None) == 0.0
    assert compute_ifbench_reward(None, None, {"instruction_id_list": ["keywords:contains"]}) == 0.0
    assert compute_ifbench_reward("text", None, {"instruction_id_list": [None, ""]}) == 0.0


@pytest.mark.skipif(IFBENCH_INSTALLED, reason="the IFBench package is installed here")
def test_missing_package_is_named_with_the_fix():
    with pytest.raises(
        ImportError, match="rm_type ifbench: the IFBench package `ifbench` is not installed: pip install"
    ):
        compute_ifbench_reward("text", None, {"instruction_id_list": ["keywords:contains"]})
    # IFBench is not on PyPI: the fix installs it from its repository
    fix = r"pip install git\+https://github\.com/allenai/IFBench "
    with pytest.raises(ValueError, match=r"--eval-config rm_type 'ifbench': .*" + fix):
        validate_rm_type("ifbench", flag="--eval-config rm_type")
    with pytest.raises(SlimeArgumentError, match="--rm-type ifbench: .*github.com/allenai/IFBench"):
        make_args("--rm-type", "ifbench")


@pytest.fixture
def ifbench_package(tmp_path, monkeypatch):
    """An `ifbench` package with IFBench's registry interface and one checker (see the module docstring)."""
    package = tmp_path / "ifbench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "instructions_registry.py").write_text(
        textwrap.dedent(
            """
            class Keyword:
                def __init__(self, instruction_id):
                    self.keyword = None

                def build_description(self, keyword=None):
                    self.keyword = keyword

                def get_instruction_args(self):
                    return {"keyword": self.keyword}

                def check_following(self, value):
                    return self.keyword in value

            INSTRUCTION_DICT = {"keywords:existence": Keyword}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("ifbench", "ifbench.instructions_registry"):
        sys.modules.pop(name, None)


def test_reward_through_the_package(ifbench_package):
    metadata = {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keyword": "cat"}], "prompt_text": "p"}
    assert compute_ifbench_reward("a cat sat", None, metadata) == 1.0
    assert compute_ifbench_reward("a dog sat", None, metadata) == 0.0
    validate_rm_type("ifbench")  # the package is importable, so the type is accepted
