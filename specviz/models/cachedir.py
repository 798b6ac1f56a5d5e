"""The specviz cache folder: converted models, compiled graphs, this machine's kernel table."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """SPECVIZ_CACHE, default ~/.cache/specviz."""
    return Path(os.environ.get("SPECVIZ_CACHE", Path.home() / ".cache" / "specviz"))
