"""docs/performance.md's benchmark section as `bench/all.py` rewrites it: a run of some benchmarks
(`--only`) replaces their tables and keeps the others."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_all(monkeypatch_module: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch_module.syspath_prepend(str(BENCH))  # all.py imports benchlib beside it
    spec = importlib.util.spec_from_file_location("bench_all_under_test", BENCH / "all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch
    sys.modules.pop("benchlib", None)


def table(name: str, value: str) -> str:
    return f"**{name}** (`bench/x.py`; runs 3)\n\n| figure | value | unit |\n| --- | --- | --- |\n| a | {value} | x |\n"


def test_a_run_of_some_benchmarks_keeps_the_tables_of_the_others(bench_all: ModuleType) -> None:
    section = "\n" + table("engine", "1") + "\n" + table("rebalance", "2") + "\n" + table("spark", "3")
    merged = bench_all.merge_section(section, {"sidecar": table("sidecar", "4"), "engine": table("engine", "5")})
    assert merged == "\n".join([table("engine", "5"), table("sidecar", "4"), table("rebalance", "2"),
                                table("spark", "3")])


def test_the_figures_section_is_unchanged_by_a_run_of_nothing(bench_all: ModuleType) -> None:
    figures = (BENCH.parent / "docs" / "performance.md").read_text()
    section = figures.split(bench_all.BEGIN, 1)[1].split(bench_all.END, 1)[0]
    assert bench_all.merge_section(section, {}) == section.lstrip("\n")
