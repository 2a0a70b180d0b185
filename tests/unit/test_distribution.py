"""The split of the suite between workers (tests/fixtures/distribution.py)."""

from __future__ import annotations

from tests.fixtures.distribution import Module, group_modules

SHARED = {"ring": "ring", "images": "images", "node_stack": "images"}


def module(name: str, *fixtures: str, integration: bool = True) -> Module:
    return Module(name, frozenset(fixtures), integration)


def test_modules_of_one_shared_server_run_in_its_group_before_everything_else() -> None:
    modules = [
        module("tests/unit/test_a.py", integration=False),
        module("tests/integration/test_publish.py", "backends"),
        module("tests/integration/test_ring.py", "ring"),
        module("tests/integration/test_images.py", "images", "backends"),
        module("tests/integration/test_ring_contracts.py", "ring", "backends"),
        module("tests/integration/test_node.py", "node_stack"),
    ]
    assert group_modules(modules, SHARED) == [
        ("ring", ["tests/integration/test_ring.py", "tests/integration/test_ring_contracts.py"]),
        ("images", ["tests/integration/test_images.py", "tests/integration/test_node.py"]),
        ("tests/integration/test_publish.py", ["tests/integration/test_publish.py"]),
        ("tests/unit/test_a.py", ["tests/unit/test_a.py"]),
    ]


def test_a_module_that_uses_two_shared_servers_joins_their_groups_into_one() -> None:
    modules = [
        module("tests/integration/test_ring.py", "ring"),
        module("tests/integration/test_images.py", "images"),
        module("tests/integration/test_both.py", "ring", "images"),
    ]
    ((name, members),) = group_modules(modules, SHARED)
    assert members == ["tests/integration/test_ring.py", "tests/integration/test_images.py",
                       "tests/integration/test_both.py"]
    assert name in {"ring", "images"}


def test_integration_modules_come_before_unit_modules_and_keep_their_order() -> None:
    modules = [
        module("tests/unit/test_b.py", integration=False),
        module("tests/integration/test_y.py", "backends"),
        module("tests/unit/test_a.py", integration=False),
        module("tests/integration/test_x.py", "backends"),
    ]
    assert [name for name, _ in group_modules(modules, SHARED)] == [
        "tests/integration/test_y.py", "tests/integration/test_x.py", "tests/unit/test_b.py", "tests/unit/test_a.py"]
