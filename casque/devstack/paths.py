"""Where the local stack keeps downloaded artifacts (cache) and running state (data, logs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Artifacts that survive between runs: Maven-resolved jars, built binaries."""
    root = os.environ.get("CASQUE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "casque"
    )
    return Path(root)


def state_dir() -> Path:
    """Data, logs and pid files of the stack that `casque dev up` runs."""
    root = os.environ.get("CASQUE_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "casque", "dev"
    )
    return Path(root)
