"""Watch health: notice when the operator's watch stream silently stops delivering changes.

kopf reconnects a watch that sends nothing (not even a bookmark) for a while, but a stream can
also stall in ways a client cannot see from inside: a proxy that keeps the connection open
and drops the events, a stream stuck behind a hung worker. The symptom is always the same:
the API server has moved an object on, the operator's copy has not.

So the liveness probe compares two views of every watched object: the resourceVersion the
watch last delivered (kopf keeps it in an index) and the one a fresh LIST returns. A
difference is normal for a moment, since a LIST can overtake the watch. It is a stall only
when it persists for `stall_after` seconds *and* the watch delivered nothing new for that
object in the meantime. Then the probe fails, the kubelet restarts the pod, and the new
process lists everything again. A LIST that fails proves nothing about the watch (the API
server may be down for everyone), so it never fails the probe: restarting would not help.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Above kopf's watch inactivity timeout (70 s) plus a reconnect and a slow handler: a stream
# that kopf itself would have recovered by then is not reported.
DEFAULT_STALL_AFTER = 180.0


@dataclass
class _Behind:
    seen: str | None  # the resourceVersion the watch had delivered when the gap was noticed
    since: float  # monotonic time the gap was noticed


@dataclass
class WatchHealth:
    stall_after: float = DEFAULT_STALL_AFTER
    _behind: dict[tuple[str, str], _Behind] = field(default_factory=dict)

    def check(self, kind: str, seen: Mapping[str, str], listed: Mapping[str, str], now: float) -> list[str]:
        """Objects of `kind` the watch has been behind on for too long (by uid); empty if healthy.

        `seen` maps uid to the resourceVersion the watch delivered last; `listed` maps uid to
        the resourceVersion a LIST returned just now; `now` is a monotonic time.
        """
        stalled = []
        for uid, version in listed.items():
            key = (kind, uid)
            delivered = seen.get(uid)
            if delivered == version:
                self._behind.pop(key, None)
                continue
            behind = self._behind.get(key)
            if behind is None or behind.seen != delivered:
                # First noticed, or the watch moved since: it is alive, restart the clock.
                self._behind[key] = _Behind(delivered, now)
            elif now - behind.since >= self.stall_after:
                stalled.append(uid)
        for key in [key for key in self._behind if key[0] == kind and key[1] not in listed]:
            del self._behind[key]  # deleted meanwhile
        return stalled
