"""weir's cache folder: the built-in tiny model, the compiled CPU kernels, benchmark models.

$WEIR_CACHE, else $XDG_CACHE_HOME/weir, else ~/.cache/weir.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("WEIR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "weir"
    )
    return Path(root)
