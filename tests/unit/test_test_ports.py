"""The fixed ports of the test sessions' servers (Cassandra cannot listen on port 0): in
every slot, no two servers share an address and port, and none lies in Linux's ephemeral
range, where any process's outgoing connection may already hold it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from casque.devstack.stack import Stack, StackPorts
from tests.fixtures.spark_cluster import MASTER_PORT, MASTER_UI_PORT, WORKER_UI_PORT
from tests.fixtures.stack import (
    DC_RING_PORTS,
    NODE_PORTS,
    RING_PORTS,
    SECURE_PORTS,
    SLOT_PORT_STEP,
    SLOTS,
    TEST_PORTS,
    slot_ensemble,
    slot_ports,
)
from tests.integration.test_devstack_cli import DEV_PORTS, ZOOKEEPERS

EPHEMERAL_PORTS_START = 32768  # net.ipv4.ip_local_port_range's default low end


def listening(stack: Stack) -> list[tuple[str, int]]:
    """(address, port) of every server the stack starts."""
    found = [(node.address, port) for node in stack.cassandra_nodes()
             for port in (node.native_port, node.storage_port)]
    found += [("127.0.0.1", node.jmx_port) for node in stack.cassandra_nodes()]
    found += [(server.address, port) for server in stack.zookeeper().members() for port, _ in server.ports()]
    return found


def every_slots_ports() -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for slot in range(SLOTS):
        def stack(base: StackPorts, nodes: int = 1, **options: object) -> Stack:
            return Stack(Path(f"/tmp/slot-{slot}"), nodes=nodes, ports=slot_ports(base, slot), **options)  # type: ignore[arg-type]

        session = stack(TEST_PORTS)
        found += listening(session)
        found += [(m.address, port) for m in slot_ensemble(session).members() for port, _ in m.ports()]
        found += [("127.0.0.1", port + slot * SLOT_PORT_STEP) for port in (MASTER_PORT, MASTER_UI_PORT, WORKER_UI_PORT)]
        found += listening(stack(RING_PORTS, nodes=3))
        found += listening(stack(DC_RING_PORTS, nodes=2, datacenters=2))
        found += listening(stack(SECURE_PORTS, tls=True, client_auth=True, password_auth=True))
        found += listening(stack(NODE_PORTS))
        found += listening(stack(DEV_PORTS, zookeeper_nodes=ZOOKEEPERS))
    return found


def test_no_two_servers_of_any_slot_share_a_port() -> None:
    shared = {where: n for where, n in Counter(every_slots_ports()).items() if n > 1}
    assert not shared


def test_no_fixed_port_lies_where_outgoing_connections_take_theirs() -> None:
    ephemeral = sorted({port for _, port in every_slots_ports() if port >= EPHEMERAL_PORTS_START})
    assert not ephemeral
