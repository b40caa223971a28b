"""Live progress bars for the long phases of a rollout step (generation, training, weight push).

`progress(total, desc, unit)` is a tqdm bar on stderr; inside Ray actors that output reaches the driver's
console. Bars are transient (`leave=False`, the one-line summary per rollout stays) and refresh at most once a
second. `SLIME_NO_PROGRESS=1` turns them all off (e.g. for log files); `enabled=False` turns one off (ranks
other than 0).
"""

from __future__ import annotations

import os

from tqdm import tqdm


def progress(total: int | None, desc: str, unit: str, enabled: bool = True) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, leave=False, mininterval=1.0,
                disable=not enabled or os.environ.get("SLIME_NO_PROGRESS") == "1")
