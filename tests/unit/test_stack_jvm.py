"""Which of the local stack's servers run as short-lived ones (casque.devstack.jvm): a test
stack's, whose servers live for minutes, and not the developer's stack or the backends'
images, which run for hours."""

from __future__ import annotations

from pathlib import Path

from casque.devstack.backend_images import cassandra_start, zookeeper_start
from casque.devstack.cassandra import SHORT_LIVED_FLAGS
from casque.devstack.jvm import C1_ONLY_FLAGS
from casque.devstack.stack import Stack


def java_commands(stack: Stack) -> list[list[str]]:
    return ([node.java_command() for node in stack.cassandra_nodes()]
            + [member.java_command() for member in stack.zookeeper().members()])


def test_a_stack_of_short_lived_servers_runs_every_jvm_with_c1_only_and_keeps_that_in_its_state(tmp_path: Path) -> None:
    stack = Stack(tmp_path, nodes=3, zookeeper_nodes=3, short_lived=True)
    commands = java_commands(stack)
    assert len(commands) == 6
    assert all(set(C1_ONLY_FLAGS) <= set(command) for command in commands)
    stack._save()
    assert Stack.load(tmp_path) == stack


def test_a_short_lived_cassandra_node_writes_its_schema_without_flushing_it(tmp_path: Path) -> None:
    stack = Stack(tmp_path, nodes=2, short_lived=True)
    assert all(set(SHORT_LIVED_FLAGS) <= set(node.java_command()) for node in stack.cassandra_nodes())
    assert not any(set(SHORT_LIVED_FLAGS) & set(member.java_command()) for member in stack.zookeeper().members())


def test_the_developers_stack_and_the_images_keep_both_compilers_and_flush_their_schema(tmp_path: Path) -> None:
    stack = Stack(tmp_path, nodes=2)
    long_lived = {*C1_ONLY_FLAGS, *SHORT_LIVED_FLAGS}
    assert not any(long_lived & set(command) for command in java_commands(stack))
    stack._save()
    assert Stack.load(tmp_path) == stack
    assert not any(flag in launcher for flag in long_lived for launcher in (cassandra_start(), zookeeper_start()))
