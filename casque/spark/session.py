"""Building the SparkSession the jobs run in: master, connector jars, Cassandra connection.

`local[*]` is the default; the same job runs on a standalone cluster (`spark://host:7077`)
or on Kubernetes (`k8s://https://apiserver:6443`) by changing the master, or under
spark-submit running the `casque` command's script, which then gives the master and the
connector's jars (docs/spark.md). The Cassandra connection comes from the same CASQUE_* settings every casque process uses, so executors
reach the cluster the driver's settings name.

One JVM serves one Python process: `getOrCreate` returns the running session if there is
one, and the options below take effect only when the first session starts.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from casque.config import CassandraTlsSettings, Settings
from casque.devstack.pki import pkcs12_keystore, pkcs12_truststore
from casque.errors import StackError
from casque.spark import jars
from casque.spark.errors import SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"

# Java 17 closes the JDK internals Spark's memory management and serializers use. Spark's
# launcher adds these for the driver it starts itself, but not for executors launched by a
# cluster manager with an older default, so they are set explicitly for both.
JAVA17_OPTIONS = " ".join(
    f"--add-opens=java.base/{package}=ALL-UNNAMED"
    for package in (
        "java.lang", "java.lang.invoke", "java.lang.reflect", "java.io", "java.net", "java.nio",
        "java.util", "java.util.concurrent", "java.util.concurrent.atomic", "sun.nio.ch",
        "sun.nio.cs", "sun.security.action", "sun.util.calendar",
    )
) + " -Djdk.reflect.useDirectMethodHandle=false -Dio.netty.tryReflectionSetAccessible=true"


def submitted() -> bool:
    """Whether this process is a driver that spark-submit started: spark-submit then owns the
    JVM, and with it the master, the driver's classpath (--jars, --packages) and options."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


@dataclass(frozen=True)
class SparkOptions:
    # None: the master spark-submit was given (see submitted()).
    master: str | None = DEFAULT_MASTER
    app_name: str = "casque"
    # Small by default: the jobs aggregate a queue's history into small tables, and a
    # 2-core machine pays for every idle shuffle partition.
    shuffle_partitions: int = 4
    driver_memory: str = "1g"
    # "auto": the cached local jars when the install step made them, else packages.
    connector: str = "auto"
    conf: Mapping[str, str] = field(default_factory=dict)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def on_this_machine(master: str) -> bool:
    """Whether every executor of `master` runs on this machine: local mode, or a standalone
    master (or masters) on a loopback address."""
    if master.startswith("local"):
        return True
    if not master.startswith("spark://"):
        return False
    hosts = [address.rpartition(":")[0] for address in master[len("spark://"):].split(",")]
    return all(host in LOOPBACK_HOSTS for host in hosts)


def spark_conf(settings: Settings, options: SparkOptions) -> dict[str, str]:
    """Every Spark setting of a casque job, as plain strings (testable without a JVM)."""
    conf: dict[str, str] = {
        "spark.app.name": options.app_name,
        "spark.sql.shuffle.partitions": str(options.shuffle_partitions),
        "spark.sql.session.timeZone": "UTC",
        # Progress bars on the console would mix with the CLI's own output.
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": options.driver_memory,
        "spark.driver.extraJavaOptions": f"{JAVA17_OPTIONS} -Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": f"{JAVA17_OPTIONS} -Duser.timezone=UTC",
        # Lets Spark SQL plan direct joins against Cassandra partitions and read write times.
        "spark.sql.extensions": "com.datastax.spark.connector.CassandraSparkExtensions",
        "spark.cassandra.connection.host": ",".join(settings.cassandra_contact_points),
        "spark.cassandra.connection.port": str(settings.cassandra_port),
        "spark.cassandra.input.consistency.level": settings.consistency,
        # Pages of 5,000 rows instead of 1,000: a quarter of the round trips for small messages.
        "spark.cassandra.input.fetch.sizeInRows": "5000",
        "spark.cassandra.output.consistency.level": settings.consistency,
        "spark.pyspark.driver.python": sys.executable,
    }
    if options.master is not None:
        conf["spark.master"] = options.master
    if settings.cassandra_local_dc:
        conf["spark.cassandra.connection.localDC"] = settings.cassandra_local_dc
    if settings.cassandra_username:
        conf["spark.cassandra.auth.username"] = settings.cassandra_username
        # Spark redacts settings whose names contain "password" from its UI and event logs.
        password = settings.cassandra_password.get_secret_value() if settings.cassandra_password else ""
        conf["spark.cassandra.auth.password"] = password
    if settings.cassandra_tls.enabled:
        conf.update(tls_conf(settings.cassandra_tls))
    if options.master is not None and on_this_machine(options.master):
        # The jobs run no Python on executors (every step is Spark SQL, planned in the JVM),
        # so executors need the connector jars alone, which the driver serves them through
        # spark.jars. Should a Python worker ever start, on this machine it is the driver's
        # interpreter; on a cluster it is the executors' own (spark.pyspark.python, or
        # PYSPARK_PYTHON in their image), since this path means nothing there.
        conf["spark.pyspark.python"] = sys.executable
        # A job whose executors all run here talks to nobody else: the driver bound to
        # loopback, where a standalone master and worker on 127.0.0.1 reach it.
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    if options.master is not None and options.master.startswith("local"):
        # No UI port to collide with other processes on the machine, and no JVM chatter.
        conf["spark.ui.enabled"] = "false"
        conf["spark.driver.extraJavaOptions"] += f" -Dlog4j2.configurationFile={_quiet_logging()}"
    if not submitted():
        # Under spark-submit the driver's JVM is running already: jars named now would reach
        # the executors but not the driver's classpath, so the connector comes with
        # spark-submit's own --jars or --packages instead.
        conf.update(_connector_conf(options.connector))
    conf.update(options.conf)
    return conf


# Forward-secret AEAD suites only: TLS 1.3's, then TLS 1.2's with ECDHE.
TLS_SUITES = (
    "TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
)


def tls_conf(tls: CassandraTlsSettings) -> dict[str, str]:
    """The connector's TLS settings for casque's PEM files. The connector reads Java key
    stores only, so the CA and the client's certificate and key are copied into PKCS12 stores
    in a private directory that lives as long as this process. Executors on other machines
    need the stores at the same paths: give them the spark.cassandra.connection.ssl.*
    settings of their own through SparkOptions.conf, which wins over these."""
    conf = {"spark.cassandra.connection.ssl.enabled": "true",
            # The connector's default suites are two RSA key-exchange suites of TLS 1.0 days,
            # which a node with an EC certificate, or a TLS 1.3-only one, refuses.
            "spark.cassandra.connection.ssl.enabledAlgorithms": ",".join(TLS_SUITES)}
    if tls.ca_file is None and tls.cert_file is None:
        return conf  # the JVM's own trusted CAs
    directory = Path(tempfile.mkdtemp(prefix="casque-spark-tls-"))  # mode 0700
    atexit.register(shutil.rmtree, directory, True)
    password = secrets.token_hex(16)
    try:
        if tls.ca_file is not None:
            pkcs12_truststore(tls.ca_file, directory / "truststore.p12", password)
            conf |= {"spark.cassandra.connection.ssl.trustStore.path": str(directory / "truststore.p12"),
                     "spark.cassandra.connection.ssl.trustStore.password": password,
                     "spark.cassandra.connection.ssl.trustStore.type": "PKCS12"}
        if tls.cert_file is not None and tls.key_file is not None:
            pkcs12_keystore(tls.cert_file, tls.key_file, directory / "keystore.p12", password)
            conf |= {"spark.cassandra.connection.ssl.clientAuth.enabled": "true",
                     "spark.cassandra.connection.ssl.keyStore.path": str(directory / "keystore.p12"),
                     "spark.cassandra.connection.ssl.keyStore.password": password,
                     "spark.cassandra.connection.ssl.keyStore.type": "PKCS12"}
    except StackError as error:
        raise SparkUnavailable(f"the Cassandra TLS files could not be made into Java key stores: {error}") from error
    return conf


# Spark's own console logging at WARN, the connector's and Hadoop's start-up notices at ERROR:
# a CLI command prints its result, not the JVM's chatter.
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = error
logger.connector.name = com.datastax
logger.connector.level = error
logger.spark_util.name = org.apache.spark.util.Utils
logger.spark_util.level = error
"""


def _quiet_logging() -> Path:
    path = jars.cache_root() / "spark-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_LOG4J2)
    return path


def _connector_conf(mode: str) -> dict[str, str]:
    if mode not in ("auto", "local", "packages"):
        raise SparkUnavailable(f"connector mode must be auto, local or packages, not {mode!r}")
    local = jars.local_jars() if mode in ("auto", "local") else None
    if local is not None:
        return {"spark.jars": ",".join(str(p) for p in local)}
    if mode == "local":
        raise SparkUnavailable(
            f"the Cassandra connector jars are not in {jars.jars_dir()}; run scripts/install-spark.sh"
        )
    return {
        "spark.jars.packages": jars.CONNECTOR,
        "spark.jars.repositories": jars.MAVEN_CENTRAL,
        "spark.jars.ivySettings": str(jars.ivy_settings()),
        "spark.jars.ivy": str(jars.ivy_dir()),
    }


def build_session(settings: Settings, options: SparkOptions | None = None) -> SparkSession:
    """Start (or join) the process's SparkSession with casque's settings."""
    options = options or SparkOptions()
    try:
        from pyspark.sql import SparkSession
    except ImportError as missing:
        raise SparkUnavailable("PySpark is not installed: pip install 'casque[spark]'") from missing
    conf = spark_conf(settings, options)
    # PySpark launches the JVM itself; it must not pick up a submit configuration meant for
    # another program.
    os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
    if options.master is not None and on_this_machine(options.master):
        # Otherwise Spark binds its block manager to the first non-loopback interface it finds.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as error:  # py4j and the launcher raise plain exceptions
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        master = options.master or "spark-submit's master"
        raise SparkUnavailable(f"the Spark session did not start ({master}): {first}") from error
    session.sparkContext.setLogLevel("WARN")
    return session
