"""Sidecar memory under abuse: the peak RSS of a `casque sidecar` process against its limit.

    python bench/bench_sidecar_abuse.py [--cassandra 127.0.0.1:9042] [--zookeeper 127.0.0.1:2181]

Runs on the local stack (`casque dev up`) in a keyspace of its own, dropped at the end. The
sidecar runs as its own process; this process abuses it, phase by phase, and reads the
kernel's high-water mark of the sidecar's resident memory (VmHWM) after each phase:
- legal batches as large as the request limit takes, 4 at a time;
- batches over the limit, declared (Content-Length) and chunked, 16 at a time;
- deep nesting through `data` (refused) and `data_base64` (stored, delivered as bytes);
- receives of up to 1,000 messages of 64 KiB (the receive byte budget cuts them);
- 64 clients trickling their bodies at once.
Prints the peak against LIMIT_MIB (the goal; the injected container's limit is 256 MiB)
and how many answers were 5xx (must be none).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from casque.engine import catalog
from casque.schema import QueueRef
from casque.specs import QueueSpec, SubscriberSpec
from casque.store import Store

from bench_sidecar import start_sidecar, wait_ready
from benchlib import arguments, drop_scratch, scratch_settings, sidecar_url

LIMIT_MIB = 200
MiB = 1024 * 1024
REQUEST_LIMIT = 4 * MiB  # the sidecar's default
JSON = {"Content-Type": "application/json"}


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def post(http: aiohttp.ClientSession, path: str, body: bytes, statuses: Counter[int]) -> int:
    try:
        async with http.post(path, data=body, headers=JSON) as answer:
            await answer.read()
            statuses[answer.status] += 1
            return answer.status
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        statuses[0] += 1  # the sidecar closed a refused upload: expected for oversize bodies
        return 0


def raw_request(url: str, head: str, chunks: list[bytes]) -> int:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        try:
            sock.sendall(head.encode())
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:
            pass
        answer = sock.recv(200)
    return int(answer.split()[1]) if answer else 0


async def main() -> None:
    args = arguments((__doc__ or "").splitlines()[0], 0, 0).parse_args()
    settings = scratch_settings(args.cassandra, args.zookeeper)
    store = Store.open(settings)
    queue = QueueRef("default", "abuse")
    log = Path(f"/tmp/{settings.keyspace}-sidecar.log")
    process = None
    statuses: Counter[int] = Counter()
    peaks: list[tuple[str, float]] = []
    try:
        catalog.ensure_installation(store)
        catalog.apply_queue(store, queue, QueueSpec(shards=4, retention_seconds=3600, consistency="ONE",
                                                    max_message_bytes=MiB))
        catalog.apply_subscriber(store, queue, queue.name, SubscriberSpec(queue=queue.name, start_position="earliest"))
        process = start_sidecar(settings, queue.name, queue.name, log)
        url = await asyncio.to_thread(sidecar_url, process, log)
        await wait_ready(url, process, log)
        publish, sub = f"/v1/queues/{queue.name}/messages", f"/v1/queues/{queue.name}/subscribers/{queue.name}"
        peaks.append(("ready, idle", peak_rss_mib(process.pid)))

        async with aiohttp.ClientSession(url) as http:
            # Legal batches just under the limit: 1,000 messages of ~3.9 KiB.
            text = "x" * 3900
            legal = json.dumps({"messages": [{"data": text} for _ in range(1000)]}).encode()
            assert len(legal) < REQUEST_LIMIT
            for _ in range(8):
                await asyncio.gather(*(post(http, f"{publish}/batch", legal, statuses) for _ in range(4)))
            peaks.append(("32 batches of 1,000 x 3.9 KiB (4 at once)", peak_rss_mib(process.pid)))

            # Over the limit: the 1,000 x 27 KiB batch, and declared/chunked giants.
            over = json.dumps({"messages": [{"data": "y" * 27 * 1024} for _ in range(1000)]}).encode()
            await asyncio.gather(*(post(http, f"{publish}/batch", over, statuses) for _ in range(8)))
            declared = (f"POST {publish}/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {512 * MiB}\r\n\r\n")
            chunked = (f"POST {publish}/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n")
            chunk = f"{MiB:x}\r\n".encode() + b"z" * MiB + b"\r\n"
            answers = await asyncio.gather(
                *(asyncio.to_thread(raw_request, url, declared, []) for _ in range(8)),
                *(asyncio.to_thread(raw_request, url, chunked, [chunk] * 8) for _ in range(8)),
            )
            statuses.update(answers)
            peaks.append(("16 x 27 MiB and 8 x 512 MiB declared, 8 x 8 MiB chunked", peak_rss_mib(process.pid)))

            # Deep nesting through data (refused) and data_base64 (stored, delivered as bytes).
            deep = b"[" * (REQUEST_LIMIT // 2 - 16) + b"]" * (REQUEST_LIMIT // 2 - 16)
            await post(http, publish, b'{"data": ' + deep[: REQUEST_LIMIT - 64] + b"}", statuses)
            poison = b"[" * 300_000 + b"]" * 300_000
            wrapped = json.dumps({"data_base64": base64.b64encode(poison).decode(),
                                  "datacontenttype": "application/json"}).encode()
            for _ in range(4):
                await post(http, publish, wrapped, statuses)
            peaks.append(("deep nesting through data and data_base64", peak_rss_mib(process.pid)))

            # Large receives: 64 KiB messages, max 1,000 each time; the byte budget cuts each answer.
            big = json.dumps({"messages": [{"data": "w" * 64 * 1024} for _ in range(50)]}).encode()
            for _ in range(10):
                await post(http, f"{publish}/batch", big, statuses)
            peaks.append(("10 batches of 50 x 64 KiB", peak_rss_mib(process.pid)))
            received = 0
            while True:
                async with http.post(f"{sub}/receive", json={"max": 1000, "wait": 1}) as answer:
                    statuses[answer.status] += 1
                    messages: list[dict[str, Any]] = (await answer.json())["messages"]
                if not messages:
                    break
                received += len(messages)
                if os.environ.get("BENCH_TRACE"):
                    print(len(messages), peak_rss_mib(process.pid))
                async with http.post(f"{sub}/ack", json={"receipts": [m["receipt"] for m in messages]}) as answer:
                    statuses[answer.status] += 1
            peaks.append((f"received and acked {received} messages, max 1,000 per call", peak_rss_mib(process.pid)))

            # Slow clients: 64 bodies trickling at once (each gets 408 after the body timeout).
            slow = [socket.create_connection(tuple(url.removeprefix("http://").split(":")))  # type: ignore[arg-type]
                    for _ in range(64)]
            for sock in slow:
                sock.sendall(f"POST {publish} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {REQUEST_LIMIT}\r\n\r\n".encode() + b"{" * 1000)
            await post(http, publish, b'{"data": "while slow"}', statuses)
            for sock in slow:
                sock.close()
            peaks.append(("64 trickling clients", peak_rss_mib(process.pid)))

        print(f"casque sidecar under abuse: peak RSS (VmHWM) of the sidecar process, goal < {LIMIT_MIB} MiB")
        for label, mib in peaks:
            print(f"  after {label:60s} {mib:7.1f} MiB")
        peak = max(mib for _, mib in peaks)
        print(f"peak {peak:.1f} MiB = {peak / LIMIT_MIB:.2f} x the {LIMIT_MIB} MiB goal "
              f"({'within' if peak < LIMIT_MIB else 'OVER'})")
        print("answers by status (0: connection closed by the sidecar on a refused upload): "
              + ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items())))
        server_errors = sum(n for status, n in statuses.items() if status >= 500)
        print(f"5xx answers: {server_errors}")
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
        drop_scratch(store, settings)
        store.close()


if __name__ == "__main__":
    asyncio.run(main())
