"""The billing worker of examples/app-deployment.yaml: casque-client's subscribe() and a handler.

It needs no configuration: the injection webhook sets CASQUE_SIDECAR_URL, _QUEUE and
_SUBSCRIBERS in its container, and the client reads them. A handler that returns acks its
message; one that raises nacks it with the error, and it comes back after a backoff (to the
subscriber's dead-letter queue after maxDeliveries). On SIGTERM the worker stops receiving,
lets running handlers finish and nacks what it cannot finish, so a redeploy loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from casque_client import Message, subscribe


async def bill(message: Message) -> None:
    order = message.data
    if not isinstance(order, dict) or "order" not in order:
        raise ValueError(f"not an order: {order!r}")
    # Delivery is at-least-once: a real biller would charge idempotently, keyed by the message's
    # id (casque's message_id, or the producer's own id).
    print(f"billed order {order['order']} (message {message.message_id}, delivery {message.delivery_count})",
          flush=True)


async def main() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    concurrency = int(os.environ.get("WORKER_CONCURRENCY", "8"))
    await subscribe(None, None, bill, concurrency=concurrency, stop=stop)
    print("worker stopped", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(main())
