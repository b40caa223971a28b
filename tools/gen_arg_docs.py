"""Write docs/argument_reference.md from the argument parser: every flag, by group, with default and help.

    python tools/gen_arg_docs.py            # rewrite docs/argument_reference.md
    python tools/gen_arg_docs.py --check    # exit 1 when the file is stale (tests/unit/test_arg_docs.py)
"""

from __future__ import annotations

import argparse
import os
import sys

from slime.config.arguments import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "argument_reference.md")
HEADER = """# Argument reference

Generated from the parser by `python tools/gen_arg_docs.py`; do not edit by hand (a test fails when it is
stale). Behaviour and couplings: [arguments.md](arguments.md). Besides these, `--sglang-<field>` forwards any
field of SGLang's `ServerArgs` and `--router-<field>` any sglang-router flag.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default in (False, None) else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{_cell(action.default)}`"


def render() -> str:
    parser = build_parser()
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and "--help" not in a.option_strings]
        if not actions:
            continue
        out.append(f"\n## {group.title}\n")
        if group.description:
            out.append(f"{_cell(group.description)}\n")
        out.append("| flag | default | meaning |\n| --- | --- | --- |")
        for a in actions:
            flags = ", ".join(f"`{f}`" for f in a.option_strings)
            if a.choices:
                flags += " {" + ", ".join(map(str, a.choices)) + "}"
            out.append(f"| {flags} | {_default(a)} | {_cell(a.help or '')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/argument_reference.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if current != text:
            print(f"{OUT} is stale: run python tools/gen_arg_docs.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
