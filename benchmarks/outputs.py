"""Where a benchmark leaves its figures: ``<out>.json`` for tools, ``<out>.md`` for people."""

from __future__ import annotations

import json
import os
from typing import Any


def save(out: str, data: Any, md: str) -> None:
    """Write ``data`` to ``<out>.json`` and ``md`` to ``<out>.md`` (folders made), and print ``md``."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
