"""The standalone ZooKeeper 3.9 server of the local stack.

The tick is 500 ms so that the smallest session timeout is 1 s: fault tests expire
sessions on purpose and should not wait long for it. Clients still ask for their own
timeout (kazoo's default is 10 s).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from casque.devstack import processes
from casque.devstack.artifacts import ZOOKEEPER
from casque.errors import StackError


@dataclass(frozen=True)
class ZooKeeperServer:
    directory: Path
    address: str = "127.0.0.1"
    client_port: int = 2181
    heap_mb: int = 256

    @property
    def connect_string(self) -> str:
        return f"{self.address}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "zookeeper.log"

    def write_config(self) -> None:
        d = self.directory.resolve()
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        (self.directory / "zoo.cfg").write_text(
            f"tickTime=500\ninitLimit=10\nsyncLimit=5\n"
            f"dataDir={d}/data\nclientPort={self.client_port}\n"
            f"clientPortAddress={self.address}\n"
            "minSessionTimeout=1000\nmaxSessionTimeout=60000\n"
            "maxClientCnxns=0\nadmin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,stat,mntr\n"
            "autopurge.snapRetainCount=3\nautopurge.purgeInterval=1\n"
        )
        (self.directory / "logback.xml").write_text(
            f"""<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{self.log_path.resolve()}</file>
    <encoder><pattern>%date{{ISO8601}} %-5level [%thread] %logger{{20}} - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""
        )

    def start(self) -> int:
        self.write_config()
        processes.rotate(self.log_path)
        d = self.directory.resolve()
        return processes.spawn(
            self.directory,
            [
                "java",
                processes.owner_marker(self.directory),
                f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
                f"-Dlogback.configurationFile={d}/logback.xml",
                "-Dzookeeper.admin.enableServer=false",
                "-cp", ZOOKEEPER.classpath(),
                "org.apache.zookeeper.server.ZooKeeperServerMain",
                f"{d}/zoo.cfg",
            ],
            "stdout.log",
        )

    def pid(self) -> int | None:
        return processes.running_pid(self.directory)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until a client session can be opened and a read completes."""
        from kazoo.client import KazooClient

        # kazoo logs every refused connection; while waiting for startup those are expected.
        logging.getLogger("kazoo.client").setLevel(logging.CRITICAL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid() is None:
                raise StackError(self._failure("exited during startup"))
            client = KazooClient(hosts=self.connect_string, timeout=5.0)
            try:
                client.start(timeout=2.0)
                client.get_children("/")
                return
            except Exception:  # any failure here only means "not ready yet"
                time.sleep(0.3)
            finally:
                client.stop()
                client.close()
        raise StackError(self._failure(f"did not answer within {timeout:.0f}s"))

    def _failure(self, what: str) -> str:
        tail = processes.log_tail(self.log_path, 200) + processes.log_tail(self.directory / "stdout.log", 50)
        errors = [line for line in tail if "ERROR" in line or "Exception" in line]
        reason = errors[-1].strip() if errors else "no error line in the log"
        return f"ZooKeeper {self.connect_string} {what}: {reason} (log: {self.log_path})"

    def stop(self) -> bool:
        return processes.terminate(self.directory, grace_seconds=15.0)
