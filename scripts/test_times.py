"""Where a test run's time went: seconds per module from a pytest JUnit XML report.

    python scripts/test_times.py report.xml [--top 30]

Prints each module's summed test time (setup, call and teardown), heaviest first, and the
total: with N workers the run's wall time is at least 1/N of it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path


def seconds_by_module(report: Path) -> Counter[str]:
    totals: Counter[str] = Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        parts = case.get("classname", "?").split(".")
        while len(parts) > 1 and parts[-1][:1].isupper():
            parts.pop()  # a test class: its module's time
        totals[".".join(parts)] += float(case.get("time", "0"))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not args.report.exists():
        sys.exit(f"test_times: no report at {args.report}")
    totals = seconds_by_module(args.report)
    print(f"test time by module (top {args.top} of {len(totals)}):")
    for module, seconds in totals.most_common(args.top):
        print(f"{seconds:9.1f}s  {module}")
    print(f"{sum(totals.values()):9.1f}s  all modules")


if __name__ == "__main__":
    main()
