"""The sidecar's settings for CPython's cycle collector: what lives as long as the process is
kept out of its collections, and the young generation is collected less often.

The collector runs a young collection every 700 container allocations, an older one every
ten of those, and now and then a full one that traverses every tracked object: after the
imports (pydantic's schemas, the drivers, the CLI) over 80,000 that live as long as the
process, plus the Cassandra driver's schema metadata once connected. A 100-message
publish allocates a few thousand containers (parsed bodies, messages, futures, results), so
collections ran every call, and py-spy --native showed `gc_collect_main` as the largest
single native entry of the sidecar while it published 100 per call.

`settle()` collects once and freezes what is left (`gc.freeze`: moved to a generation
that is never traversed), called when the process is set up and again when the backends
are connected; the young threshold goes up so that the objects of a call, nearly all
freed by their reference counts, are traversed less often. Cyclic garbage then waits
longer to be freed: at most YOUNG_THRESHOLD containers' worth.
"""

from __future__ import annotations

import gc

# 700 by default. Higher cut little more CPU once the rest was frozen, and cost RSS: at
# 20,000 the sidecar ended bench_sidecar's phases 7-10 MiB larger than at this.
YOUNG_THRESHOLD = 3_000


def settle() -> None:
    """Freeze what exists now (after a collection, so no garbage is kept) and raise the young
    threshold. Objects frozen stay until the process ends: call it when what exists is
    the process's own setup, not requests in flight."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def release_free_pages() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`), once the
    backends are connected: connecting (TLS contexts, the schema read, the drivers'
    handshakes) frees memory in the middle of the heap, which glibc keeps resident. Nothing
    where the C library has no such call."""
    import ctypes  # here, not at import: the sidecar loads it once, other processes never

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
