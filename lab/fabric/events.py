"""The controller's event logs (JSON lines with a wall-clock "t"), read by the lab."""
from __future__ import annotations

import json
from pathlib import Path


def read(path: Path, since: float = 0.0) -> list[dict]:
    """Complete lines only (the controller may be writing the last one)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    e = json.loads(line)
                    if e["t"] >= since:
                        out.append(e)
    except FileNotFoundError:
        pass
    return out
