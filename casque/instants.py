"""Points in time as casque takes them from users: aware, in UTC."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

FIRST_INSTANT = datetime.min.replace(tzinfo=timezone.utc)
LAST_INSTANT = datetime.max.replace(tzinfo=timezone.utc)


def in_utc(moment: datetime) -> datetime:
    """`moment` in UTC (taken as UTC when it names no zone).

    0001-01-01T00:30:00+05:30 is a valid RFC 3339 time whose UTC form lies before year 1
    (9999-12-31T23:59:59-05:00 one past 9999), which Python cannot represent. As a point in
    time it is before (after) every other, so the first (last) instant stands for it and gets
    the same answer: a seek there is older than any retention, a delivery time there is past
    (beyond any retention)."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:
        return FIRST_INSTANT if (moment.utcoffset() or timedelta()) > timedelta() else LAST_INSTANT


def rfc3339(moment: datetime) -> str:
    """RFC 3339 in UTC (`...Z`), or in the value's own offset where UTC cannot express it
    (year 1 or 9999 near its edge): a producer's time is kept, never moved."""
    try:
        moment = moment.astimezone(timezone.utc)
    except OverflowError:
        return moment.isoformat()
    return moment.isoformat().replace("+00:00", "Z")
