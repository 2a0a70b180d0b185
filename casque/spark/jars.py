"""The Spark Cassandra Connector's jars: resolved from Maven Central once, into the cache.

Two ways to put the connector on Spark's classpath:

- local jars (the default when present): `scripts/install-spark.sh` runs Maven once to copy
  the connector and its runtime dependencies into `~/.cache/casque/spark-jars/<version>/`,
  and sessions pass them as `spark.jars`. Nothing is downloaded when a job starts, and on a
  cluster the driver serves the jars to its executors.
- packages: without the local copy, `spark.jars.packages` lets Spark resolve the same
  coordinate with Ivy at session start, from Maven Central only (an Ivy settings file of our
  own replaces Spark's default resolver chain, which also asks a third-party repository).

Jars that PySpark already ships (Scala, slf4j, commons-lang3, ...) are left out of the copy:
the classpath would otherwise hold two versions of each.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from casque.devstack.paths import cache_dir
from casque.spark.errors import SparkUnavailable

SCALA_BINARY = "2.12"
CONNECTOR_VERSION = "3.5.1"
CONNECTOR = f"com.datastax.spark:spark-cassandra-connector_{SCALA_BINARY}:{CONNECTOR_VERSION}"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2/"

# group:artifact of dependencies that the pyspark distribution provides itself.
PROVIDED_BY_SPARK = (
    "org.scala-lang:scala-library",
    "org.scala-lang:scala-reflect",
    "org.slf4j:slf4j-api",
    "org.apache.commons:commons-lang3",
    "com.thoughtworks.paranamer:paranamer",
    "io.dropwizard.metrics:metrics-core",
)

_STAMP = "complete"


def cache_root() -> Path:
    return cache_dir()


def jars_dir() -> Path:
    return cache_dir() / "spark-jars" / CONNECTOR_VERSION


def _pom() -> str:
    group, artifact, version = CONNECTOR.split(":")
    exclusions = "".join(
        f"<exclusion><groupId>{g}</groupId><artifactId>{a}</artifactId></exclusion>"
        for g, a in (entry.split(":") for entry in PROVIDED_BY_SPARK)
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>io.casque.spark</groupId><artifactId>connector-jars</artifactId>"
        "<version>1</version><packaging>pom</packaging>"
        f"<dependencies><dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
        f"<version>{version}</version><exclusions>{exclusions}</exclusions></dependency></dependencies>"
        "</project>\n"
    )


def local_jars() -> list[Path] | None:
    """The cached jars, or None when the install step has not completed for this version."""
    directory = jars_dir()
    stamp = directory / _STAMP
    if not stamp.exists() or stamp.read_text() != _pom():
        return None
    jars = sorted((directory / "lib").glob("*.jar"))
    return jars or None


def install() -> list[Path]:
    """Copy the connector and its dependencies into the cache unless an earlier run did."""
    cached = local_jars()
    if cached is not None:
        return cached
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SparkUnavailable("Maven (mvn) is not installed; run scripts/install.sh first")
    directory = jars_dir()
    lib = directory / "lib"
    if lib.exists():
        shutil.rmtree(lib)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pom.xml").write_text(_pom())
    # -C: refuse a jar whose checksum does not match the repository's instead of caching it.
    result = subprocess.run(
        [mvn, "-B", "-q", "-C", "-f", str(directory / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={lib}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        raise SparkUnavailable(f"Maven could not resolve {CONNECTOR}: {' | '.join(tail)}")
    (directory / _STAMP).write_text(_pom())
    jars = local_jars()
    assert jars is not None
    return jars


def ivy_dir() -> Path:
    """Ivy's cache for the packages way."""
    return cache_dir() / "spark-ivy"


def ivy_settings() -> Path:
    """An Ivy settings file that resolves `spark.jars.packages` from Maven Central only."""
    path = ivy_dir() / "ivysettings.xml"
    text = (
        "<ivysettings>\n"
        '  <settings defaultResolver="central"/>\n'
        "  <resolvers>\n"
        f'    <ibiblio name="central" m2compatible="true" root="{MAVEN_CENTRAL}"/>\n'
        "  </resolvers>\n"
        "</ivysettings>\n"
    )
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


# A class of the connector that its DataFrame source needs: loading it proves the classpath.
PROBE_CLASS = "com.datastax.spark.connector.datasource.CassandraCatalog"


def check() -> str:
    """Start a local Spark session on the cached jars and load the connector (once per jar set)."""
    jars = local_jars()
    if jars is None:
        raise SparkUnavailable(f"the connector jars are not in {jars_dir()}")
    stamp = jars_dir() / "checked"
    if stamp.exists() and stamp.read_text() == _pom():
        return "checked earlier"
    from casque.config import Settings
    from casque.spark.session import SparkOptions, build_session

    session = build_session(Settings(), SparkOptions(master="local[1]", connector="local", app_name="casque-check"))
    try:
        jvm: Any = session.sparkContext._jvm
        # Through Spark's class loader: spark.jars are not on the JVM's own class path.
        loaded = str(jvm.org.apache.spark.util.Utils.classForName(PROBE_CLASS, True, False).getName())
    finally:
        session.stop()
    stamp.write_text(_pom())
    return f"loaded {loaded}"


def main(argv: list[str] | None = None) -> None:
    """`python -m casque.spark.jars [--check]`: the install step; prints what it did."""
    args = sys.argv[1:] if argv is None else argv
    try:
        jars = install()
        print(f"{len(jars)} connector jars in {jars[0].parent}")
        if "--check" in args:
            print(f"Spark local session with the connector: {check()}")
    except SparkUnavailable as error:
        print(f"casque: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
