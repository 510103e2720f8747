"""Printing a benchmark's result and saving it as JSON, the same way in every benchmark script."""
from __future__ import annotations

import json
from typing import Any


def report(result: dict[str, Any], path: str | None) -> None:
    print(json.dumps(result, indent=2), flush=True)
    save(result, path)


def save(result: dict[str, Any], path: str | None) -> None:
    """Write the result as JSON (for scripts that print their own summary lines); no path: nothing."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
