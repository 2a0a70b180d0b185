"""`casque sidecar` whose ack-row writes time out at the driver, every other one
(tests.fixtures.ack_faults). Usage: python -m tests.integration.flaky_sidecar sidecar FLAGS..."""

from __future__ import annotations

from casque.cli.main import main
from tests.fixtures.ack_faults import time_out_every_other_ack_row

time_out_every_other_ack_row()
main()
