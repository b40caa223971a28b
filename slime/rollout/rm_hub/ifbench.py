"""The `ifbench` reward at slime's path (`slime.rollout.rm_hub.ifbench`): IFBench's strict instruction following.

A sample's metadata describes its instructions: `instruction_id_list` (IFBench / IFEval ids such as
`keywords:existence`), `kwargs` (one dict per instruction, or one dict for all; missing entries repeat the
last one, None values are dropped) and `prompt_text` (for the checkers that read the prompt). The reward is
1.0 when the response follows every instruction under IFBench's strict test, else 0.0; a None response, no
metadata or no instruction ids score 0.0.

The checkers themselves are IFBench's (`ifbench.instructions_registry`; not on PyPI: `pip install
git+https://github.com/allenai/IFBench`, or a clone of it on PYTHONPATH). It is imported on first use, not with
this module, since it pulls in nltk and friends; without it `--rm-type ifbench` fails when the flags are validated,
naming what to install. slime instead clones IFBench and pip-installs its requirements at import time; nothing here
downloads anything.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

IFBENCH_PACKAGE = "ifbench"
INSTALL_HINT = (
    "pip install git+https://github.com/allenai/IFBench (IFBench's instruction checkers; it is not on PyPI), or "
    "put a clone of https://github.com/allenai/IFBench on PYTHONPATH"
)

KwargsDict = dict[str, Any]


def ifbench_missing_reason() -> str | None:
    """Why the IFBench checkers cannot be used here (None when the package is importable)."""
    if importlib.util.find_spec(IFBENCH_PACKAGE) is None:
        return f"the IFBench package `{IFBENCH_PACKAGE}` is not installed: {INSTALL_HINT}"
    return None


def _instruction_registry() -> dict[str, type]:
    reason = ifbench_missing_reason()
    if reason is not None:
        raise ImportError(f"rm_type ifbench: {reason}")
    try:
        registry = importlib.import_module(f"{IFBENCH_PACKAGE}.instructions_registry")
    except ImportError as e:
        raise ImportError(f"rm_type ifbench: importing IFBench failed ({e}); {INSTALL_HINT}") from e
    return registry.INSTRUCTION_DICT


def _normalize_instruction_ids(raw_ids: Sequence[Any] | None) -> list[str]:
    """The ids as clean strings, None and blank entries dropped."""
    return [str(entry).strip() for entry in raw_ids or [] if entry is not None and str(entry).strip()]


def _coerce_kwargs_list(raw_kwargs: Any, num_instructions: int) -> list[KwargsDict]:
    """Exactly one kwargs dict per instruction (see the module docstring), without None values."""
    if isinstance(raw_kwargs, list):
        entries = [dict(entry) if isinstance(entry, dict) else {} for entry in raw_kwargs]
    elif isinstance(raw_kwargs, dict):
        entries = [dict(raw_kwargs) for _ in range(num_instructions)]
    else:
        entries = [{} for _ in range(num_instructions)]
    last = entries[-1] if entries else {}
    entries = (entries + [dict(last) for _ in range(num_instructions - len(entries))])[:num_instructions]
    return [{key: value for key, value in entry.items() if value is not None} for entry in entries]


def follows_all_instructions(
    registry: dict[str, type], instruction_ids: list[str], kwargs_list: list[KwargsDict], prompt: str, response: str
) -> bool:
    """IFBench's strict test: each checker built from its kwargs (and the prompt, when it takes one) must accept
    the response as it is; a blank response follows nothing. Every checker runs, as in IFBench, so one that
    cannot run here (e.g. nltk data missing) fails every sample alike rather than only some."""
    if not response.strip():
        return False
    followed = []
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
        if instruction_id not in registry:
            raise ValueError(
                f"rm_type ifbench: unknown instruction id {instruction_id!r} in metadata['instruction_id_list'] "
                f"(IFBench knows {len(registry)} ids, e.g. {sorted(registry)[:3]})"
            )
        checker = registry[instruction_id](instruction_id)
        checker.build_description(**kwargs)
        if "prompt" in (checker.get_instruction_args() or {}):
            checker.build_description(prompt=prompt)
        followed.append(bool(checker.check_following(response)))
    return all(followed)


def compute_ifbench_reward(response: str | None, label: Any, metadata: dict | None = None) -> float:
    """1.0 when `response` follows every instruction of `metadata`, else 0.0 (`label` is not used)."""
    if metadata is None or response is None:
        return 0.0
    instruction_ids = _normalize_instruction_ids(metadata.get("instruction_id_list"))
    if not instruction_ids:
        return 0.0
    prompt = metadata.get("prompt_text")
    kwargs_list = _coerce_kwargs_list(metadata.get("kwargs"), len(instruction_ids))
    registry = _instruction_registry()
    followed = follows_all_instructions(
        registry, instruction_ids, kwargs_list, "" if prompt is None else str(prompt), str(response)
    )
    return 1.0 if followed else 0.0
