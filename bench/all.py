"""Every benchmark, one after the other, and docs/performance.md's tables from their results.

    python bench/all.py [--runs 3] [--smoke] [--only engine,sidecar,rebalance,shared,keys,latency,spark,schema,filter,history,pipeline,scale,soak]
        [--out DIR] [--reuse DIR] [--figures docs/performance.md] [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs each benchmark as its own process with `--json` (a benchmark's driver threads, Spark JVM
and sidecar never outlive it), keeps each JSON document in `--out`, and renders one Markdown
section from them. With `--figures` their tables replace those between the document's
`<!-- bench:begin -->` and `<!-- bench:end -->` lines; the tables of benchmarks not run
(`--only`) stay as they were. A failing benchmark does not stop the
others; the exit code is 1 if any failed. `scripts/bench.sh` runs this on the local stack.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import cell

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "engine": "bench_engine.py",
    "sidecar": "bench_sidecar.py",
    "rebalance": "bench_rebalance.py",
    "shared": "bench_shared.py",
    "keys": "bench_keys.py",
    # Publish -> first delivery through sidecars in each delivery mode, beside the drivers' floor.
    "latency": "bench_latency.py",
    "spark": "bench_spark_scan.py",
    # No backend: a queue schema's check per message, fastjsonschema against jsonschema.
    "schema": "bench_schema.py",
    # No backend: a subscriber filter's variables and CEL evaluation per message.
    "filter": "bench_filter.py",
    # A message's history read back (casque trace), and the ids that make it possible.
    "history": "bench_history.py",
    # An ack that publishes: the derived keys' extra requests and CPU per output.
    "pipeline": "bench_pipeline.py",
    # The model's inputs on the given stack and its check there (its ring check, which starts
    # a three-node ring, only when run by hand with --ring).
    "scale": "scale_model.py",
    # A sidecar's memory under a long run of mixed traffic (--minutes by hand for hours).
    "soak": "soak_sidecar.py",
}
# Benchmarks that run once whatever --runs says: one run is their measure (a soak's length).
ONE_RUN = {"soak"}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def run(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any] | None:
    """One benchmark's JSON document, or None when it failed (its stderr is kept in out)."""
    if args.reuse is not None:
        document = json.loads((args.reuse / f"{name}.json").read_text())
        (out / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
        return document
    runs = 1 if name in ONE_RUN else args.runs
    command = [sys.executable, str(HERE / BENCHMARKS[name]), "--json", "--runs", str(runs),
               "--cassandra", args.cassandra, "--zookeeper", args.zookeeper]
    if args.smoke:
        command.append("--smoke")
    started = time.monotonic()
    print(f"bench/all: {name} ...", file=sys.stderr, flush=True)
    with (out / f"{name}.err").open("wb") as errors:
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=errors, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            print(f"bench/all: {name} timed out after {args.timeout:.0f}s", file=sys.stderr)
            return None
    seconds = time.monotonic() - started
    if done.returncode != 0:
        print(f"bench/all: {name} failed (exit {done.returncode}, {seconds:.0f}s):\n"
              f"{(out / f'{name}.err').read_text(errors='replace')[-3000:]}", file=sys.stderr)
        return None
    document: dict[str, Any] = json.loads(done.stdout)
    document["seconds"] = round(seconds, 1)
    (out / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"bench/all: {name} done in {seconds:.0f}s", file=sys.stderr, flush=True)
    return document


def render(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The table of each benchmark, by name, each figure its median and (min-max)."""
    tables = {}
    for name, document in results.items():
        context = ", ".join(f"{key} {value}" for key, value in document["context"].items())
        runs = document["runs"]
        lines = [f"**{name}** (`bench/{BENCHMARKS[name]}`; {context}; median of {runs} runs, (min-max))", "",
                 "| figure | value | unit |", "| --- | --- | --- |"]
        for figure in document["figures"].values():
            label = figure["label"]
            indent = "&emsp;" if label.startswith(" ") else ""
            lines.append(f"| {indent}{label.strip()} | {cell(figure, figure['unit'])} | {figure['unit']} |")
        tables[name] = "\n".join(lines) + "\n"
    return tables


def merge_section(section: str, tables: dict[str, str]) -> str:
    """The figures section with `tables` in place of those benchmarks' tables, and the tables
    of benchmarks not run this time kept as they were (`--only` updates only what it ran)."""
    kept = {
        match.group(1): match.group(0).strip("\n") + "\n"
        for match in re.finditer(r"(?ms)^\*\*(\w+)\*\* \(.*?(?=^\*\*\w+\*\* \(|\Z)", section)
    }
    merged = {**kept, **tables}
    return "\n".join(merged[name] for name in sorted(merged, key=_order))


def _order(name: str) -> tuple[int, str]:
    return (list(BENCHMARKS).index(name), name) if name in BENCHMARKS else (len(BENCHMARKS), name)


def update_figures(document: Path, tables: dict[str, str]) -> None:
    text = document.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{document} has no {BEGIN} ... {END} section to update")
    head, rest = text.split(BEGIN, 1)
    section, tail = rest.split(END, 1)
    document.write_text(f"{head}{BEGIN}\n{merge_section(section, tables)}{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="every benchmark once with small counts")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", type=Path, help="where the JSON documents go (default: a new temporary directory)")
    parser.add_argument("--figures", type=Path, help="update this document's benchmark section "
                        "(docs/performance.md)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    parser.add_argument("--reuse", type=Path, help="render the JSON documents a run left in this directory "
                        "(its --out, or a benchmark's own --json output saved as <name>.json) instead of running")
    parser.add_argument("--cassandra", default=os.environ.get("CASQUE_BENCH_CASSANDRA", "127.0.0.1:9042"))
    parser.add_argument("--zookeeper", default=os.environ.get("CASQUE_BENCH_ZOOKEEPER", "127.0.0.1:2181"))
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks: {', '.join(unknown)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="casque-bench-"))
    out.mkdir(parents=True, exist_ok=True)

    results = {name: document for name in names if (document := run(name, args, out)) is not None}
    tables = render(results)
    section = "\n".join(tables.values())
    (out / "figures-section.md").write_text(section)
    print(section)
    print(f"bench/all: results in {out}", file=sys.stderr)
    failed = [name for name in names if name not in results]
    if failed:
        raise SystemExit(f"bench/all: failed: {', '.join(failed)} (figures not updated)")
    if args.figures is not None:
        update_figures(args.figures, tables)
        print(f"bench/all: updated {args.figures}", file=sys.stderr)


if __name__ == "__main__":
    main()
