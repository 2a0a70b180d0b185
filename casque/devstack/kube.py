"""A throwaway Kubernetes control plane for tests: etcd plus kube-apiserver, nothing else.

There is no kubelet, scheduler or controller-manager, so objects are stored and validated
(CRDs, CEL rules, RBAC, admission webhooks) but Pods never run and no controller reconciles
anything. That is enough to test an operator's API interactions against a real server.
``for_node=True`` starts it ready for casque.devstack.node, which adds a node and the
controllers.

Binaries come from ``scripts/install-kube-tools.sh`` and are looked up in
``$CASQUE_KUBE_BIN`` or else ``${CASQUE_CACHE:-~/.cache/casque}/kube/bin``.

    with start_kube_api(tmp_path) as cluster:
        subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig_path), "get", "ns"])

Certificates and the service-account key are made with the ``openssl`` command line tool
(casque.devstack.pki).
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from casque.devstack.pki import issue_cert, make_ca, openssl

__all__ = [
    "INSTALL_SCRIPT",
    "KubeCluster",
    "KubeStartError",
    "KubeToolsMissing",
    "kube_bin_dir",
    "kube_binary",
    "missing_kube_binaries",
    "start_kube_api",
]

INSTALL_SCRIPT = "scripts/install-kube-tools.sh"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
# First address of SERVICE_CLUSTER_IP_RANGE: the in-cluster "kubernetes" Service.
_KUBERNETES_SERVICE_IP = "10.0.0.1"
ADMIN_USER = "casque-admin"
ADMIN_GROUP = "system:masters"
_REQUIRED_BINARIES = ("etcd", "kube-apiserver")
_ADDRESS_IN_USE = "address already in use"


class KubeToolsMissing(FileNotFoundError):
    """The etcd / kube-apiserver / kubectl / helm binaries are not installed."""


class KubeStartError(RuntimeError):
    """etcd or kube-apiserver did not start or did not become ready in time."""


def kube_bin_dir() -> Path:
    """Directory holding the binaries built by ``scripts/install-kube-tools.sh``."""
    explicit = os.environ.get("CASQUE_KUBE_BIN")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("CASQUE_CACHE") or str(Path.home() / ".cache" / "casque")
    return Path(cache).expanduser() / "kube" / "bin"


def missing_kube_binaries(names: Sequence[str] = _REQUIRED_BINARIES) -> list[str]:
    """Names among ``names`` that are not executable files in :func:`kube_bin_dir`."""
    bin_dir = kube_bin_dir()
    return [n for n in names if not os.access(bin_dir / n, os.X_OK)]


def kube_binary(name: str) -> Path:
    """Path of one tool (``etcd``, ``kube-apiserver``, ``kubectl`` or ``helm``).

    Raises :class:`KubeToolsMissing`, naming the install script, if it is absent.
    """
    path = kube_bin_dir() / name
    if not os.access(path, os.X_OK):
        raise KubeToolsMissing(
            f"{name} not found at {path}; run `bash {INSTALL_SCRIPT}` to build it "
            "(or set CASQUE_KUBE_BIN to a directory that has it)"
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_service_account_key(pki: Path) -> tuple[Path, Path]:
    key, pub = pki / "sa.key", pki / "sa.pub"
    openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-out", key.name,
        cwd=pki,
    )
    openssl("pkey", "-in", key.name, "-pubout", "-out", pub.name, cwd=pki)
    return key, pub


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, so a killed test run leaves no servers."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only use it from the
    # main thread (pytest fixtures run there); elsewhere rely on stop()/atexit.
    preexec = (
        _die_with_parent
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread()
        else None
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class KubeCluster:
    """A running etcd + kube-apiserver pair. Stop it with :meth:`stop` or a ``with`` block."""

    workdir: Path
    server_url: str
    token: str
    kubeconfig_path: Path
    ca_cert_path: Path
    ca_key_path: Path
    etcd_url: str
    etcd_log: Path
    apiserver_log: Path
    _etcd: subprocess.Popen[bytes] | None = field(repr=False, default=None)
    _apiserver: subprocess.Popen[bytes] | None = field(repr=False, default=None)

    @property
    def user(self) -> str:
        """The user the token authenticates as (member of ``system:masters``)."""
        return ADMIN_USER

    @property
    def ca_bundle(self) -> str:
        """Base64 of the CA certificate, as used in kubeconfigs and webhook ``caBundle``s."""
        return base64.b64encode(self.ca_cert_path.read_bytes()).decode("ascii")

    def running(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self._etcd, self._apiserver))

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_cert_path))

    def issue_serving_cert(self, name: str, hosts: Sequence[str]) -> tuple[Path, Path]:
        """Sign a serving cert/key pair with the cluster CA, e.g. for an admission webhook
        listening on 127.0.0.1 (use :attr:`ca_bundle` as the webhook's ``caBundle``)."""
        return issue_cert(
            self.ca_cert_path.parent, self.ca_cert_path, self.ca_key_path, name, hosts
        )

    def kubectl_args(self) -> list[str]:
        """``[kubectl, --kubeconfig, path]``, ready for ``subprocess.run(args + [...])``."""
        return [str(kube_binary("kubectl")), "--kubeconfig", str(self.kubeconfig_path)]

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate kube-apiserver, then etcd, and wait for both (SIGKILL after ``timeout``)."""
        terminate(self._apiserver, timeout)
        terminate(self._etcd, timeout)

    def __enter__(self) -> KubeCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_until(
    what: str,
    ready: Callable[[], bool],
    procs: Sequence[tuple[str, subprocess.Popen[bytes], Path]],
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise KubeStartError(
                    f"{name} exited with code {proc.returncode} while waiting for {what}; "
                    f"log: {log}\n{log_tail(log)}"
                )
        if ready():
            return
        if time.monotonic() > deadline:
            logs = ", ".join(str(log) for _, _, log in procs)
            raise KubeStartError(
                f"timed out after {timeout:.0f}s waiting for {what}; logs: {logs}\n"
                f"{log_tail(procs[-1][2])}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def _http_ok(url: str, *, context: ssl.SSLContext | None = None, token: str = "") -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=context) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _write_kubeconfig(path: Path, server_url: str, ca_crt: Path, token: str) -> None:
    # JSON is valid YAML, so kubectl, helm and the Python client all read it.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "casque-test",
                "cluster": {
                    "server": server_url,
                    "certificate-authority-data": base64.b64encode(
                        ca_crt.read_bytes()
                    ).decode("ascii"),
                },
            }
        ],
        "users": [{"name": ADMIN_USER, "user": {"token": token}}],
        "contexts": [
            {
                "name": "casque-test",
                "context": {"cluster": "casque-test", "user": ADMIN_USER, "namespace": "default"},
            }
        ],
        "current-context": "casque-test",
        "preferences": {},
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def start_kube_api(
    workdir: Path,
    *,
    timeout: float = 90.0,
    extra_apiserver_args: Sequence[str] = (),
    attempts: int = 3,
    address: str = "127.0.0.1",
    for_node: bool = False,
) -> KubeCluster:
    """Start etcd and kube-apiserver on free ports, wait for ``/readyz``.

    The API server listens on ``address`` (etcd always on 127.0.0.1). ``for_node`` makes it
    serve a node's pods as a cluster does (casque.devstack.node): ``address`` must then be one
    that pods reach, as the ``kubernetes`` Service's endpoint; the ServiceAccount admission
    plugin gives pods their tokens; webhooks are called on their Service's endpoints (the
    pods' addresses, which the host routes to) rather than on the Service's cluster IP; and
    the API server reaches kubelets on their node addresses with a client certificate.

    All state (etcd data, certificates, token file, kubeconfig, logs) lives under
    ``workdir``. Ports are picked free but may be taken by someone else before the servers
    bind them; in that case the start is retried on new ports up to ``attempts`` times.
    """
    etcd_bin = kube_binary("etcd")
    apiserver_bin = kube_binary("kube-apiserver")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    pki = workdir / "pki"
    pki.mkdir(exist_ok=True)
    ca_crt, ca_key = make_ca(pki)
    serving_crt, serving_key = issue_cert(
        pki, ca_crt, ca_key, "apiserver",
        [address, "127.0.0.1", "localhost", _KUBERNETES_SERVICE_IP, "kubernetes",
         "kubernetes.default", "kubernetes.default.svc",
         "kubernetes.default.svc.cluster.local"],
    )
    sa_key, sa_pub = _make_service_account_key(pki)
    aggregation_args = _aggregation_layer(pki / "front-proxy")
    node_args: list[str] = []
    if for_node:
        kubelet_crt, kubelet_key = issue_cert(pki, ca_crt, ca_key, "apiserver-kubelet-client", client=True)
        node_args = [
            "--endpoint-reconciler-type=lease",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={kubelet_crt}",
            f"--kubelet-client-key={kubelet_key}",
        ]
    else:
        node_args = [
            # No controller-manager creates the "default" ServiceAccount in namespaces,
            # so this admission plugin would reject every Pod.
            "--disable-admission-plugins=ServiceAccount",
            # The "kubernetes" Service's Endpoints may not point at a loopback address,
            # so the default lease reconciler would log an error every few seconds.
            "--endpoint-reconciler-type=none",
        ]
    token = secrets.token_urlsafe(32)
    token_file = pki / "tokens.csv"
    token_file.write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"{ADMIN_GROUP}"\n')
    token_file.chmod(0o600)

    last_error: KubeStartError | None = None
    for attempt in range(1, attempts + 1):
        try:
            return _start_once(
                workdir, etcd_bin, apiserver_bin, attempt,
                ca_crt, ca_key, serving_crt, serving_key, sa_key, sa_pub,
                token, token_file, timeout, [*aggregation_args, *node_args, *extra_apiserver_args], address,
            )
        except KubeStartError as err:
            last_error = err
            if _ADDRESS_IN_USE not in str(err):
                raise
    assert last_error is not None
    raise last_error


# The name the API server's front-proxy client certificate carries, and an extension API
# server (casque's External Metrics API) accepts proxied requests from.
FRONT_PROXY_CLIENT = "front-proxy-client"


def _aggregation_layer(pki: Path) -> list[str]:
    """The API server's flags for the aggregation layer: a CA of its own for the client
    certificate it presents to extension API servers (APIServices) when it proxies a request,
    with the caller's name and groups in headers. It publishes the CA and the header names in
    kube-system's extension-apiserver-authentication ConfigMap for those servers to check.
    It calls an APIService on its Service's endpoints, not the Service's cluster IP, as
    nothing here routes cluster IPs."""
    ca_crt, ca_key = make_ca(pki, "casque-test-front-proxy-ca")
    client_crt, client_key = issue_cert(pki, ca_crt, ca_key, FRONT_PROXY_CLIENT, client=True)
    return [
        f"--requestheader-client-ca-file={ca_crt}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={client_crt}",
        f"--proxy-client-key-file={client_key}",
        "--enable-aggregator-routing=true",
    ]


def _start_once(
    workdir: Path,
    etcd_bin: Path,
    apiserver_bin: Path,
    attempt: int,
    ca_crt: Path,
    ca_key: Path,
    serving_crt: Path,
    serving_key: Path,
    sa_key: Path,
    sa_pub: Path,
    token: str,
    token_file: Path,
    timeout: float,
    extra_apiserver_args: Sequence[str],
    address: str,
) -> KubeCluster:
    etcd_client_port, etcd_peer_port, secure_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_client_port}"
    etcd_peer_url = f"http://127.0.0.1:{etcd_peer_port}"
    server_url = f"https://{address}:{secure_port}"
    etcd_data = workdir / "etcd-data"
    if etcd_data.exists():
        shutil.rmtree(etcd_data)
    etcd_log = workdir / f"etcd.{attempt}.log"
    apiserver_log = workdir / f"kube-apiserver.{attempt}.log"
    deadline = time.monotonic() + timeout

    etcd = spawn(
        [
            str(etcd_bin),
            "--name=casque-test",
            f"--data-dir={etcd_data}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={etcd_peer_url}",
            f"--initial-advertise-peer-urls={etcd_peer_url}",
            f"--initial-cluster=casque-test={etcd_peer_url}",
            "--initial-cluster-state=new",
            # Test data is disposable: skip fsync, it dominates latency on small disks.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
        etcd_log,
    )
    apiserver: subprocess.Popen[bytes] | None = None
    try:
        _wait_until(
            "etcd /health",
            lambda: _http_ok(f"{etcd_url}/health"),
            [("etcd", etcd, etcd_log)],
            max(deadline - time.monotonic(), 1.0),
        )
        apiserver = spawn(
            [
                str(apiserver_bin),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={address}",
                f"--advertise-address={address}",
                f"--secure-port={secure_port}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={serving_crt}",
                f"--tls-private-key-file={serving_key}",
                f"--token-auth-file={token_file}",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--service-account-issuer={server_url}",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--allow-privileged=true",
                "--profiling=false",
                *extra_apiserver_args,
            ],
            apiserver_log,
        )
        ctx = ssl.create_default_context(cafile=str(ca_crt))
        _wait_until(
            f"kube-apiserver {server_url}/readyz",
            lambda: _http_ok(f"{server_url}/readyz", context=ctx, token=token),
            [("etcd", etcd, etcd_log), ("kube-apiserver", apiserver, apiserver_log)],
            max(deadline - time.monotonic(), 1.0),
        )
    except BaseException:
        terminate(apiserver, 10.0)
        terminate(etcd, 10.0)
        raise

    kubeconfig = workdir / "kubeconfig"
    _write_kubeconfig(kubeconfig, server_url, ca_crt, token)
    cluster = KubeCluster(
        workdir=workdir,
        server_url=server_url,
        token=token,
        kubeconfig_path=kubeconfig,
        ca_cert_path=ca_crt,
        ca_key_path=ca_key,
        etcd_url=etcd_url,
        etcd_log=etcd_log,
        apiserver_log=apiserver_log,
        _etcd=etcd,
        _apiserver=apiserver,
    )
    # Safety net for callers that forget stop(); stop() is idempotent.
    atexit.register(cluster.stop)
    return cluster

