"""The SGLang rollout engine: `SGLangEngine` (sglang_engine.py) launches real SGLang servers; arguments.py checks
and renders `--sglang-<field>` flags against sglang's ServerArgs. The trainer's side of SGLang's weight-update
calls is `slime.weight_sync`. See docs/sglang_backend.md.

Importing this package does not import sglang.
"""

from slime.backends.sglang_utils.sglang_engine import SGLangEngine

__all__ = ["SGLangEngine"]
