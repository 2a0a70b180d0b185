"""Resolves the Java servers of the local stack from Maven Central, once, into the cache.

Cassandra 5.0's binary tarball is not published to Maven Central, so the server runs from
`cassandra-all` and its resolved dependencies (the daemon class is the same one the tarball
starts). Maven runs with strict checksums (`-C`): a jar whose checksum does not match the
repository's is refused instead of cached.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from casque.devstack.paths import cache_dir
from casque.errors import StackError

CASSANDRA_VERSION = "5.0.6"
ZOOKEEPER_VERSION = "3.9.4"
LOGBACK_VERSION = "1.3.15"


@dataclass(frozen=True)
class MavenBundle:
    """A set of Maven coordinates copied, with their runtime dependencies, into one lib dir."""

    name: str
    coordinates: tuple[str, ...]

    @property
    def lib_dir(self) -> Path:
        return cache_dir() / "java" / self.name / "lib"

    def classpath(self) -> str:
        return ":".join(str(p) for p in sorted(self.lib_dir.glob("*.jar")))

    def jar(self, prefix: str) -> Path:
        for path in sorted(self.lib_dir.glob(f"{prefix}-*.jar")):
            return path
        raise StackError(f"{prefix} jar missing from {self.lib_dir}; run `casque dev install`")


CASSANDRA = MavenBundle(
    f"cassandra-{CASSANDRA_VERSION}", (f"org.apache.cassandra:cassandra-all:{CASSANDRA_VERSION}",)
)
ZOOKEEPER = MavenBundle(
    f"zookeeper-{ZOOKEEPER_VERSION}",
    (
        f"org.apache.zookeeper:zookeeper:{ZOOKEEPER_VERSION}",
        f"ch.qos.logback:logback-classic:{LOGBACK_VERSION}",
        # ZooKeeper declares these optional, but its server needs them to start.
        "io.dropwizard.metrics:metrics-core:4.2.28",
        "org.xerial.snappy:snappy-java:1.1.10.7",
    ),
)


def _pom(bundle: MavenBundle) -> str:
    deps = []
    for coordinate in bundle.coordinates:
        group, artifact, version = coordinate.split(":")
        deps.append(
            f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
            f"<version>{version}</version></dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        f"<groupId>io.casque.devstack</groupId><artifactId>{bundle.name}</artifactId>"
        "<version>1</version><packaging>pom</packaging>"
        f"<dependencies>{''.join(deps)}</dependencies></project>\n"
    )


def ensure_bundle(bundle: MavenBundle) -> Path:
    """Resolve `bundle` into the cache unless a completed earlier run left it there."""
    stamp = bundle.lib_dir.parent / "complete"
    pom = _pom(bundle)
    if stamp.exists() and stamp.read_text() == pom:
        return bundle.lib_dir
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (mvn) is not installed; run scripts/install.sh")
    work = bundle.lib_dir.parent
    if bundle.lib_dir.exists():
        shutil.rmtree(bundle.lib_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "pom.xml").write_text(pom)
    result = subprocess.run(
        [mvn, "-B", "-q", "-C", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={bundle.lib_dir}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        raise StackError(f"Maven could not resolve {bundle.name}: {' | '.join(tail)}")
    stamp.write_text(pom)
    return bundle.lib_dir


def ensure_all() -> None:
    ensure_bundle(CASSANDRA)
    ensure_bundle(ZOOKEEPER)
