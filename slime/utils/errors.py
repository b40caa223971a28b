"""`SlimeArgumentError`: a command-line problem, found before anything starts (or by a backend checking the
flags it needs). Defined on the floor so that every layer may raise it; `train.py` prints its message
without a traceback."""

from __future__ import annotations


class SlimeArgumentError(ValueError):
    """The message names the flag(s), value(s) and the fix."""
