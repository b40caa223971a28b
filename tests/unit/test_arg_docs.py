"""docs/argument_reference.md is generated from the parser and must match it."""

from __future__ import annotations

from tools.gen_arg_docs import main, render


def test_argument_reference_is_current():
    assert main(["--check"]) == 0, "docs/argument_reference.md is stale: run python tools/gen_arg_docs.py"


def test_every_flag_of_the_parser_is_listed():
    from slime.config.arguments import build_parser

    text = render()
    flags = [f for a in build_parser()._actions for f in a.option_strings if f not in ("-h", "--help")]
    assert len(flags) > 200
    assert all(f"`{f}`" in text for f in flags), [f for f in flags if f"`{f}`" not in text]
