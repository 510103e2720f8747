"""Helpers every room may use: `cdiv`, and `require_extra` for optional dependencies."""
from __future__ import annotations

import importlib.util


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many size-`b` pieces hold `a` items."""
    return -(-a // b)


class MissingExtraError(ValueError):
    """An optional dependency a feature needs is not installed. A ValueError, so that the command line
    prints it as one `error:` line, like every other configuration fault."""


def require_extra(feature: str, extra: str, *modules: str) -> None:
    """Raise MissingExtraError naming `feature`, the missing modules and the extra that installs them,
    e.g. "embedding signals need transformers: pip install 'shardserve[router]'". Looks the modules up
    without importing them, so configuration checks stay fast."""
    missing = [m.rsplit(".", 1)[-1] for m in modules if not installed(m)]   # google.protobuf: protobuf
    if missing:
        raise MissingExtraError(f"{feature} {', '.join(missing)}: pip install 'shardserve[{extra}]'")


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # a parent package missing, or a half-removed module
        return False
