"""Pieces shared by the argument-group modules: the error type and small formatting helpers."""

from __future__ import annotations

import argparse
import os

from slime.utils.errors import SlimeArgumentError


def flag(dest: str) -> str:
    """`rollout_batch_size` -> `--rollout-batch-size`."""
    return "--" + dest.replace("_", "-")


def fail(message: str) -> None:
    raise SlimeArgumentError(message)


def refuse(dest: str, value, why: str, instead: str) -> None:
    """A slime flag this implementation does not have yet: fail naming it, why, and what to do instead (a flag that
    would be parsed and ignored is worse: the run would silently differ from the user's intent)."""
    shown = "" if value is True else f" {value}"
    fail(f"{flag(dest)}{shown}: not supported here yet: {why}; {instead}.")


def require_positive(args: argparse.Namespace, *dests: str, allow_none: bool = True) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            fail(f"{flag(dest)} {value}: must be a positive number.")


def require_existing_file(dest: str, path: str | None) -> None:
    if path is not None and not os.path.isfile(path):
        fail(f"{flag(dest)} {path}: no such file (cwd: {os.getcwd()}); fix the path.")


def json_object(text: str) -> dict:
    """argparse `type` for flags that take a JSON object (e.g. --apply-chat-template-kwargs '{"a": 1}')."""
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
