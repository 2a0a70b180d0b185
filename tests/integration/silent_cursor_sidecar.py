"""`casque sidecar` whose first fresh reads of a mover's cursor get no answer from ZooKeeper
(tests.fixtures.zk_faults; how many: CASQUE_TEST_HUNG_MOVER_SYNCS, default 1), and whose publisher's clock lags the mover's: every delayed
message goes to the delayed table, however overdue. So a row due before the mover's marks
lands behind them, and only its writer's check of the cursor moves it.
Usage: python -m tests.integration.silent_cursor_sidecar sidecar FLAGS..."""

from __future__ import annotations

import os
from datetime import datetime

from casque.cli.main import main
from casque.engine.delayed_publish import DelayedRoute
from tests.fixtures.zk_faults import hang_mover_syncs


def _lagging_is_later(self: DelayedRoute, due: datetime) -> bool:
    return True


hang_mover_syncs(int(os.environ.get("CASQUE_TEST_HUNG_MOVER_SYNCS", "1")))
DelayedRoute.is_later = _lagging_is_later  # type: ignore[method-assign]
main()
