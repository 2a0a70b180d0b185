"""The stats report a person reads: PNG charts, an HTML page and a markdown summary.

Everything here works on the small tables `stats.compute` already collected; no Spark.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from casque.spark.stats import Record, StatsResult


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return str(value)


# Identifiers and positions: printed as they are, without thousands separators.
_PLAIN = frozenset({"shard", "head", "offset", "first_batch", "last_batch", "bin"})


def _number(value: Any, key: str = "") -> str:
    if value is None:
        return "-"
    if key == "share" and isinstance(value, float):
        return f"{value * 100:.1f} %"
    if isinstance(value, bool) or key in _PLAIN:
        return str(value)
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def charts(result: StatsResult) -> list[tuple[str, Path]]:
    """Draw the charts; returns (title, file) for each one drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    folder = result.out / "charts"
    folder.mkdir(parents=True, exist_ok=True)
    drawn: list[tuple[str, Path]] = []
    tables = result.tables

    def save(figure: Any, name: str, title: str) -> None:
        figure.tight_layout()
        path = folder / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        drawn.append((title, path))

    minutes = tables.get("per_minute", [])
    if minutes:
        labels = [str(r["minute"])[11:16] for r in minutes]
        figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
        top.bar(range(len(minutes)), [r["messages"] for r in minutes], color="#3b6ea5")
        top.set_ylabel("messages / min")
        bottom.plot(range(len(minutes)), [r["bytes"] / 1024 for r in minutes], color="#c0504d", marker=".")
        bottom.set_ylabel("KiB / min")
        step = max(1, len(labels) // 12)
        bottom.set_xticks(range(0, len(labels), step), labels[::step], rotation=45)
        bottom.set_xlabel(f"minute (UTC), from {str(minutes[0]['minute'])[:10]}")
        top.set_title("Publishes per minute")
        save(figure, "per_minute", "Publishes per minute")

    sizes = tables.get("sizes", [])
    if any(r["messages"] for r in sizes):
        figure, axes = plt.subplots(figsize=(8, 3.5))
        axes.bar([r["label"] for r in sizes], [r["messages"] for r in sizes], color="#4f9a6b")
        axes.set_ylabel("messages")
        axes.set_title("Message sizes (payload + key + attributes)")
        axes.tick_params(axis="x", rotation=30)
        save(figure, "sizes", "Message sizes")

    shards = tables.get("shards", [])
    if shards:
        figure, axes = plt.subplots(figsize=(max(5, 0.5 * len(shards) + 3), 3.5))
        axes.bar([str(r["shard"]) for r in shards], [r["messages"] for r in shards], color="#8064a2")
        mean = sum(r["messages"] for r in shards) / len(shards)
        axes.axhline(mean, color="grey", linestyle="--", linewidth=1, label="mean")
        axes.set_xlabel("shard")
        axes.set_ylabel("messages")
        axes.set_title("Balance over shards")
        axes.legend()
        save(figure, "shards", "Balance over shards")

    latency = tables.get("latency", [])
    if latency:
        figure, axes = plt.subplots(figsize=(8, 3.5))
        names = [r["subscriber"] for r in latency]
        width = 0.25
        for offset, (key, color) in enumerate((("p50_ms", "#3b6ea5"), ("p90_ms", "#f79646"), ("p99_ms", "#c0504d"))):
            axes.bar([i + (offset - 1) * width for i in range(len(names))],
                     [(r[key] or 0) / 1000 for r in latency], width, label=key[:-3], color=color)
        axes.set_xticks(range(len(names)), names)
        axes.set_ylabel("seconds")
        axes.set_title("Publish-to-ack latency (acks recorded as rows)")
        axes.legend()
        save(figure, "latency", "Publish-to-ack latency")

    lag = tables.get("lag", [])
    if lag:
        per_subscriber: dict[str, dict[int, int]] = defaultdict(dict)
        for r in lag:
            # Unknown (None) when the header before the offset expired: drawn as 0, listed in the table.
            per_subscriber[r["subscriber"]][r["shard"]] = r["lag_messages"] or 0
        names = sorted(per_subscriber)
        all_shards = sorted({s for values in per_subscriber.values() for s in values})
        figure, axes = plt.subplots(figsize=(8, 3.5))
        bottoms = [0] * len(names)
        for shard in all_shards:
            heights = [per_subscriber[n].get(shard, 0) for n in names]
            axes.bar(names, heights, bottom=bottoms, label=f"shard {shard}")
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        axes.set_ylabel("messages behind")
        axes.set_title("Subscriber lag now, by shard")
        if len(all_shards) <= 16:
            axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        save(figure, "lag", "Subscriber lag")
    return drawn


def _table(columns: Sequence[tuple[str, str]], rows: Sequence[Record]) -> tuple[str, str]:
    """(HTML, markdown) of rows, with (key, heading) columns."""
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_number(r.get(key), key))}</td>" for key, _ in columns) + "</tr>"
        for r in rows
    )
    markdown = ["| " + " | ".join(title for _, title in columns) + " |",
                "|" + "---|" * len(columns)]
    markdown += ["| " + " | ".join(_number(r.get(key), key) for key, _ in columns) + " |" for r in rows]
    return f"<table><tr>{head}</tr>{body}</table>", "\n".join(markdown)


def write(result: StatsResult) -> None:
    """report.html (charts inline) and summary.md in the output directory."""
    drawn = charts(result)
    s = result.summary
    size = s["size"]
    overview = [
        {"what": "queue", "value": s["queue"]},
        {"what": "range", "value": s["range"]},
        {"what": "first published", "value": s["first_published_at"] or "-"},
        {"what": "last published", "value": s["last_published_at"] or "-"},
        {"what": "messages", "value": s["messages"]},
        {"what": "batches", "value": s["batches"]},
        {"what": "bytes", "value": _human_bytes(s["bytes"])},
        {"what": "payload bytes", "value": _human_bytes(s["payload_bytes"])},
        {"what": "size p50 / p90 / p99", "value": " / ".join(_human_bytes(size[k]) for k in ("p50", "p90", "p99"))},
        {"what": "size min / mean / max", "value": " / ".join(_human_bytes(size[k]) for k in ("min", "mean", "max"))},
        {"what": "subscribers", "value": ", ".join(s["subscribers"]) or "-"},
        {"what": "partitions read", "value": s["partitions_read"]},
    ]
    sections = [
        ("Summary", [("what", ""), ("value", "")], overview),
        ("Shards", [("shard", "shard"), ("messages", "messages"), ("bytes", "bytes"), ("batches", "batches"),
                    ("first_batch", "first batch"), ("last_batch", "last batch"), ("head", "head"),
                    ("share", "share")], result.tables.get("shards", [])),
        ("Message sizes", [("label", "size"), ("messages", "messages"), ("bytes", "bytes")],
         result.tables.get("sizes", [])),
        ("Publish-to-ack latency (ms)", [("subscriber", "subscriber"), ("acked", "acked"), ("p50_ms", "p50"),
                                         ("p90_ms", "p90"), ("p99_ms", "p99"), ("max_ms", "max")],
         result.tables.get("latency", [])),
        ("Subscriber lag", [("subscriber", "subscriber"), ("shard", "shard"), ("offset", "offset"),
                            ("head", "head"), ("lag_batches", "lag (batches)"), ("lag_messages", "lag (messages)"),
                            ("oldest_unacked_at", "oldest unacked")], result.tables.get("lag", [])),
    ]
    title = f"casque stats: {s['queue']}"
    page = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:70em}"
            "table{border-collapse:collapse;margin-bottom:1.5em}"
            "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
            "td:first-child{text-align:left}img{max-width:100%;margin:.5em 0 1.5em}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>"]
    markdown = [f"# {title}", ""]
    for heading, columns, rows in sections:
        if not rows:
            continue
        table_html, table_md = _table(columns, rows)
        page += [f"<h2>{html.escape(heading)}</h2>", table_html]
        markdown += [f"## {heading}", "", table_md, ""]
    if drawn:
        page.append("<h2>Charts</h2>")
        markdown += ["## Charts", ""]
        for chart_title, path in drawn:
            relative = path.relative_to(result.out).as_posix()
            page.append(f"<h3>{html.escape(chart_title)}</h3><img src='{relative}' alt='{html.escape(chart_title)}'>")
            markdown.append(f"![{chart_title}]({relative})")
    page.append("</body></html>")
    (result.out / "report.html").write_text("\n".join(page) + "\n")
    (result.out / "summary.md").write_text("\n".join(markdown) + "\n")
