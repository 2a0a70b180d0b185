"""scripts/cpu_by_process.py names each process by what it runs, not by the paths in its
arguments: the suite's servers run from test directories whose paths name pytest."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "cpu_by_process.py"
_spec = importlib.util.spec_from_file_location("cpu_by_process", SCRIPT)
assert _spec is not None and _spec.loader is not None
cpu_by_process = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_by_process)


@pytest.mark.parametrize(("argv", "kind"), [
    (["java", "-Xmx1g", "-cp", "/c/lib/zookeeper-3.8.jar:/c/cassandra-all.jar",
      "org.apache.cassandra.service.CassandraDaemon"], "cassandra"),
    (["/usr/bin/java", "-cp", "/c/cassandra-all.jar:/c/zookeeper.jar",
      "org.apache.zookeeper.server.ZooKeeperServerMain", "/tmp/pytest-of-root/zoo.cfg"], "zookeeper"),
    (["java", "-cp", "/c/cassandra-all.jar", "org.apache.cassandra.tools.NodeTool", "status"],
     "cassandra tools (nodetool, sstable tools)"),
    (["java", "-cp", "/spark/jars/*", "org.apache.spark.deploy.worker.Worker"], "spark"),
    (["java", "-version"], "other java"),
    (["/w/.venv/bin/python", "-m", "casque.cli", "sidecar", "--port", "0"], "sidecar"),
    (["/w/.venv/bin/python", "-m", "casque.cli", "operator", "run"], "operator"),
    (["/usr/local/bin/python3", "/usr/local/bin/casque", "sidecar"], "sidecar"),
    (["/w/.venv/bin/casque", "queue", "list"], "casque CLI"),
    (["/w/.venv/bin/python", "-c", "import sys;exec(eval(sys.stdin.readline()))"], "pytest workers"),
    (["/w/.venv/bin/python", "-m", "http.server"], "other python"),
    (["/root/.cache/casque/kube/kube-apiserver", "--cert-dir=/tmp/pytest-of-root/casque"], "kube-apiserver"),
    ([], "kernel threads"),
])
def test_a_process_is_named_by_what_it_runs(argv: list[str], kind: str) -> None:
    assert cpu_by_process.kind_of(argv) == kind


def test_a_server_is_told_apart_by_its_state_directory_and_any_other_process_by_its_working_directory() -> None:
    assert cpu_by_process._where("1", ["java", "-Dcassandra.storagedir=/tmp/ring/cassandra-2",
                                      "org.apache.cassandra.service.CassandraDaemon"]) == "/tmp/ring/cassandra-2"
    assert cpu_by_process._where("1", ["java", "-cp", "z.jar", "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                                      "/tmp/stack/zookeeper/zoo.cfg"]) == "/tmp/stack/zookeeper/zoo.cfg"
    assert cpu_by_process._where(str(os.getpid()), ["python", "-m", "http.server"]) == os.getcwd()


def test_the_costliest_processes_are_listed_with_where_they_ran() -> None:
    sampler = cpu_by_process.Sampler()
    sampler.total_start -= 200.0  # as if 100 s on two cores had passed
    sampler.seen = {("10", "1"): ("cassandra", 0.0, 90.0), ("11", "1"): ("cassandra", 5.0, 20.0),
                    ("12", "1"): ("sidecar", 0.0, 40.0)}
    sampler.where = {("10", "1"): "/tmp/ring/cassandra-1", ("11", "1"): "/tmp/stack/cassandra-1",
                     ("12", "1"): "/tmp/app"}
    listed = sampler.report(wall=100.0, top=5, processes_listed=2).split("the 2 costliest processes:\n")[1]
    assert listed.splitlines() == ["       90 s  cassandra  /tmp/ring/cassandra-1", "       40 s  sidecar  /tmp/app"]


def test_what_children_used_after_their_last_sample_is_given_by_the_kind_that_started_them() -> None:
    sampler = cpu_by_process.Sampler()
    sampler.total_start -= 200.0
    worker, sidecar, gone = ("10", "1"), ("11", "5"), ("12", "6")
    podman, its_child = ("20", "1"), ("21", "7")
    sampler.seen = {worker: ("pytest workers", 0.0, 30.0), sidecar: ("sidecar", 0.0, 1.5),
                    gone: ("casque CLI", 0.0, 0.5), podman: ("podman", 0.0, 2.0), its_child: ("other", 0.0, 1.2)}
    # A worker reaped 5 s of children: a sidecar seen up to 1.5 s, whose own children (never
    # seen) used 0.2 s, a CLI seen up to 0.5 s, and what no sample saw. A parent that reaped
    # less than its children were seen using adds nothing.
    sampler.reaped = {worker: ("1", 0.0, 5.0), sidecar: ("10", 0.0, 0.2), gone: ("10", 0.0, 0.0),
                      podman: ("1", 0.0, 1.0), its_child: ("20", 0.0, 0.0)}
    sampler.alive = {worker, podman}
    assert sampler.ended_between_samples() == pytest.approx({"pytest workers": 5.0 - 1.7 - 0.5, "sidecar": 0.2})
    assert "        3 s    of it ended between samples, started by pytest workers" in sampler.report(100.0, top=5)


def test_jobs_a_shell_reaped_as_it_ended_are_not_counted_again_at_its_parent() -> None:
    """The stress run's CPU hogs: `test.sh` reaps them as it exits, after its last sample, and
    its parent then reaps it with them. What the samples saw of the hogs is not unseen CPU."""
    sampler = cpu_by_process.Sampler()
    runner, script, hog = ("1", "1"), ("30", "2"), ("31", "3")
    sampler.seen = {runner: ("bash", 0.0, 2.0), script: ("bash", 0.0, 1.0), hog: ("sh", 0.0, 100.0)}
    # The runner reaped the script's 1 s, the hog's 100 s, and 4 s nobody saw.
    sampler.reaped = {runner: ("0", 0.0, 105.0), script: ("1", 0.0, 0.0), hog: ("30", 0.0, 0.0)}
    sampler.last_sample = {runner: 9, script: 8, hog: 8}
    sampler.alive = {runner}
    assert sampler.ended_between_samples() == pytest.approx({"bash": 4.0})
