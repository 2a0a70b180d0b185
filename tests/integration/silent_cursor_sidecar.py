"""`casque sidecar` whose first fresh read of a mover's cursor gets no answer from ZooKeeper
(tests.fixtures.zk_faults), and whose publisher's clock lags the mover's: every delayed
message goes to the delayed table, however overdue. So a row due before the mover's marks
lands behind them, and only its writer's check of the cursor moves it.
Usage: python -m tests.integration.silent_cursor_sidecar sidecar FLAGS..."""

from __future__ import annotations

from datetime import datetime

from casque.cli.main import main
from casque.engine.publisher import Publisher
from tests.fixtures.zk_faults import hang_first_mover_sync


def _lagging_is_later(self: Publisher, due: datetime) -> bool:
    return True


hang_first_mover_sync()
Publisher._is_later = _lagging_is_later  # type: ignore[method-assign]
main()
