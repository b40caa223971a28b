"""The SGLang rollout engine: `SGLangEngine` (engine.py) launches real SGLang servers; arguments.py checks
and renders `--sglang-<field>` flags against sglang's ServerArgs; update_group.py forms the process group
of SGLang's `update_weights_from_distributed` on either end. See docs/sglang_backend.md.

Importing this package does not import sglang.
"""

from slime.backends.sglang_utils.engine import SGLangEngine

__all__ = ["SGLangEngine"]
