"""The `casque` command line (main.py)."""

import sys

# The Cassandra driver imports NumPy whenever it is installed (it is in development
# environments, not in the images) only to offer NumPy result pages, which casque never asks
# for: marked absent before the driver loads, it leaves a process 11 MiB smaller in RSS and
# 0.18 s of CPU quicker to start. `casque spark` keeps it: its report draws with matplotlib.
if sys.argv[1:2] != ["spark"]:
    sys.modules.setdefault("numpy", None)  # type: ignore[arg-type]

# `casque sidecar` runs in every pod, so what it holds in memory counts: aiohttp reads the
# system's table of MIME types (/etc/mime.types) when it is imported, for serving files,
# which the sidecar never does: 0.5 MiB. Python's own table is left, for anything that asks.
if sys.argv[1:2] == ["sidecar"]:
    import mimetypes

    mimetypes.knownfiles = []
