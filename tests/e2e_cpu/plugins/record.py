"""What the plugins write down: one JSON object per line in $SLIME_PLUGIN_LOG (several processes append)."""

from __future__ import annotations

import json
import os


def record(kind: str, **fields) -> None:
    path = os.environ.get("SLIME_PLUGIN_LOG")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
