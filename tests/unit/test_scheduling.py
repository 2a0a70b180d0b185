"""How a distributed run splits the suite between workers (tests/fixtures/scheduling.py)."""

from __future__ import annotations

from types import SimpleNamespace

from xdist.remote import Producer

from tests.conftest import STOPPED_AFTER_LAST_USE
from tests.fixtures.scheduling import GROUPS, GroupScheduling, misplaced, order, unit_of


class Worker:
    """What the scheduler sees of an xdist worker: the batches of test indices it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.batches: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.batches.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_test_belongs_to_its_modules_group_else_to_its_module_whatever_its_class_or_parameters() -> None:
    assert unit_of("tests/integration/test_ring_contracts.py::test_a[x::y]") == "ring"
    assert unit_of("tests/integration/test_node.py::test_pods") == "images"
    assert unit_of("tests/integration/test_publish.py::TestRetry::test_once[client id]") == \
        "tests/integration/test_publish.py"
    assert unit_of("tests/unit/test_config.py") == "tests/unit/test_config.py"


def test_units_go_out_groups_first_the_measured_longest_first_then_integration_then_unit_modules() -> None:
    units = {"tests/unit/test_a.py": 50, "tests/integration/test_few.py": 2, "ring": 3,
             "tests/integration/test_many.py": 30, "tests/unit/test_b.py": 60, "secure_stack": 21,
             "images": 14, "tests/integration/test_also_few.py": 2}
    assert order(units) == ["images", "secure_stack", "ring", "tests/integration/test_many.py",
                            "tests/integration/test_few.py", "tests/integration/test_also_few.py",
                            "tests/unit/test_b.py", "tests/unit/test_a.py"]


def test_each_worker_gets_a_whole_unit_in_collection_order_heaviest_first() -> None:
    collection = [
        "tests/integration/test_images.py::test_build",
        "tests/integration/test_images.py::test_run[sidecar]",
        "tests/integration/test_publish.py::test_one",
        "tests/integration/test_publish.py::test_two",
        "tests/integration/test_publish.py::test_three",
        "tests/integration/test_node.py::test_pods",
        "tests/integration/test_ring.py::test_ring",
        "tests/unit/test_config.py::test_a",
        "tests/unit/test_config.py::test_b",
        "tests/integration/test_ring_contracts.py::test_contract",
    ]
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True))
    scheduler = GroupScheduling(config, Producer("test", enabled=False))
    first, second = Worker("gw0"), Worker("gw1")
    for worker in (first, second):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()

    # Each starts on a group, the measured-longest first, and its tests go out together in
    # collection order; a worker with two tests or fewer to go takes the next unit at once.
    assert first.batches == [[0, 1, 5]]
    assert second.batches == [[6, 9], [2, 3, 4]]

    scheduler.mark_test_complete(first, 0)
    assert first.batches == [[0, 1, 5], [7, 8]]  # the unit test module, last
    scheduler.mark_test_complete(second, 6)
    assert second.shutting_down  # nothing left to hand out
    assert not first.shutting_down


def test_a_module_using_a_groups_server_outside_the_group_is_named() -> None:
    fixtures_of = {
        "tests/integration/test_ring.py": {"ring", "backends"},
        "tests/integration/test_new_ring_user.py": {"ring", "keyspace"},
        "tests/integration/test_node.py": {"node_stack", "kube_node"},
        "tests/integration/test_publish.py": {"backends", "store"},
        "tests/integration/test_spark_cluster.py": {"spark_cluster", "secure_stack"},
    }
    assert misplaced(fixtures_of) == {"tests/integration/test_new_ring_user.py": "ring",
                                      "tests/integration/test_spark_cluster.py": "secure_stack"}


def test_every_stack_stopped_after_its_last_use_is_a_groups_server() -> None:
    # Else its users could be several units, run in any order, and a worker could stop it
    # after the collection's last user and then start a unit that uses it.
    served = {fixture for group in GROUPS.values() for fixture in group.fixtures}
    assert set(STOPPED_AFTER_LAST_USE) <= served
