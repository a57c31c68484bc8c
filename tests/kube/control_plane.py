"""A real Kubernetes control plane on loopback, for the tests and for a developer's shell.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler, built from the Kubernetes
Go modules by `scripts/k8s_controlplane.sh`, run as the cluster runs them: TLS with a CA of
our own, RBAC authorization, service-account tokens signed by a key pair of our own (so
`kubectl create token` works and a ServiceAccount's token carries exactly its RBAC), and
a static token for the test's cluster admin, as controller-runtime's envtest does. kwok
plays the kubelets: one fake node whose pods go Running and Ready, with IPs, and are
removed when deleted; the real scheduler, ReplicaSet controller and garbage collector do
the rest.

    python -m tests.kube.control_plane     # start one, print its KUBECONFIG, wait for Ctrl-C

`stop_api_server` / `start_api_server` take the API server away and bring it back (the
same etcd, so nothing is lost), for outage tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "k8s_controlplane.sh"
ADMIN_TOKEN = "weir-test-admin-token"
NODE = "kwok-node-0"
# A large GPU node: engine pods request nvidia.com/gpu.
NODE_CAPACITY = {"cpu": "256", "memory": "2Ti", "pods": "500", "nvidia.com/gpu": "64"}


class ControlPlaneUnavailableError(RuntimeError):
    """The binaries are not built (run scripts/k8s_controlplane.sh) or did not start."""


def binaries() -> Path:
    """The folder of built binaries, without building: the build takes minutes and belongs
    to `make check`'s bootstrap, not to a test's timeout."""
    found = subprocess.run(
        ["bash", "-c", f'WEIR_K8S_PROBE_ONLY=1 "{BUILD_SCRIPT}"'],
        capture_output=True,
        text=True,
        check=False,
    )
    folder = Path(found.stdout.strip().splitlines()[-1]) if found.stdout.strip() else None
    if found.returncode != 0 or folder is None or not folder.is_dir():
        raise ControlPlaneUnavailableError(
            f"the Kubernetes control plane is not built: run {BUILD_SCRIPT.relative_to(ROOT)}"
            f" ({found.stderr.strip() or 'no output'})"
        )
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate, and the service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "30")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt",
             "-subj", "/CN=weir-test-ca", cwd=pki)  # fmt: skip
    _openssl("req", "-x509", *ec, "-CA", "ca.crt", "-CAkey", "ca.key",
             "-keyout", "apiserver.key", "-out", "apiserver.crt", "-subj", "/CN=kube-apiserver",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
             cwd=pki)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "tokens.csv").write_text(f'{ADMIN_TOKEN},weir-test-admin,1,"system:masters"\n')


def kubeconfig(server: str, ca: Path, token: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "weir-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "weir-test", "user": user}}],
        "current-context": user,
    }


class Cluster:
    """What the tests need of any cluster: kubectl as its admin, fresh namespaces, and a
    kubeconfig for a token (a ServiceAccount's). `local`: the suite's own control plane,
    whose API server a test may stop and whose node is kwok's (pods run, as far as the
    API can tell, without GPUs or images)."""

    local = False

    def __init__(self, kubeconfig: Path, bin_dir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.bin = bin_dir

    def kubectl(
        self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """kubectl of the server's own version, as the admin unless told otherwise."""
        return subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )

    def namespace(self, prefix: str) -> str:
        """A fresh namespace, whose default ServiceAccount exists (pods need it)."""
        name = f"{prefix}-{os.urandom(3).hex()}"
        made = self.kubectl("create", "namespace", name)
        assert made.returncode == 0, made.stderr
        deadline = time.monotonic() + 60
        while self.kubectl("get", "serviceaccount", "default", "-n", name).returncode != 0:
            assert time.monotonic() < deadline, f"no default ServiceAccount in {name}"
            time.sleep(0.2)
        return name

    def kubeconfig_for(self, token: str, path: Path, user: str = "user") -> Path:
        """A kubeconfig for the same cluster that authenticates with `token`."""
        view = self.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json")
        assert view.returncode == 0, view.stderr
        config = json.loads(view.stdout)
        config["users"] = [{"name": user, "user": {"token": token}}]
        config["contexts"][0]["context"]["user"] = user
        path.write_text(json.dumps(config))
        return path


class ControlPlane(Cluster):
    """One control plane in a folder of its own; a context manager."""

    local = True

    def __init__(self, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="weir-k8s-"))
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        super().__init__(self.dir / "admin.kubeconfig", binaries())
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        _make_pki(self.pki)
        self.kubeconfig.write_text(
            json.dumps(kubeconfig(self.server, self.pki / "ca.crt", ADMIN_TOKEN, "admin"))
        )
        self._start_etcd()
        self.start_api_server()
        common = ["--kubeconfig", str(self.kubeconfig), "--leader-elect=false"]
        self._spawn(
            "kube-controller-manager",
            *common,
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            "--use-service-account-credentials=false",
            # Pods of a scaled-down ReplicaSet go at once on a fake node.
            "--concurrent-deployment-syncs=2",
        )
        self._spawn(
            "kube-scheduler", *common, "--bind-address=127.0.0.1", f"--secure-port={free_port()}"
        )
        self._spawn(
            "kwok",
            "--kubeconfig",
            str(self.kubeconfig),
            f"--config={self.bin / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=10.244.0.0/16",
            "--node-ip=10.0.0.10",
            f"--server-address=127.0.0.1:{free_port()}",
        )
        self._add_fake_node()
        self.wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default").returncode == 0,
            60,
            "the default ServiceAccount",
        )
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        # Every process is told at once, so that their graceful ends overlap rather than
        # add up; then each is waited for (and killed if it outlasts its grace).
        for proc in self._procs.values():
            _signal_group(proc, signal.SIGTERM)
        for name in reversed(list(self._procs)):
            self._terminate(name)
        if self._own_dir and not os.environ.get("WEIR_KEEP_K8S"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        )
        self.wait_for(lambda: self._http_ok(f"{self.etcd_url}/health"), 30, "etcd")

    def start_api_server(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.api_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--profiling=false",
        )
        self.wait_for(
            lambda: self._http_ok(f"{self.server}/readyz", auth=True), 90, "kube-apiserver"
        )

    def stop_api_server(self) -> None:
        self._terminate("kube-apiserver")

    def compact_etcd(self) -> None:
        """Drop etcd's history up to now (through its JSON gateway): a watch that resumes
        from an older resourceVersion is then answered 410 Gone."""

        def post(path: str, body: dict[str, Any]) -> Any:
            request = urllib.request.Request(
                f"{self.etcd_url}{path}", data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as resp:
                return json.loads(resp.read())

        revision = post("/v3/kv/range", {"key": "AA=="})["header"]["revision"]
        post("/v3/kv/compaction", {"revision": revision, "physical": True})

    # -- processes --------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self._procs[name] = subprocess.Popen(
            [str(self.bin / name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def _terminate(self, name: str) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=5)

    def wait_for(self, probe: Any, limit_s: float, what: str) -> None:
        """Wait until `probe` holds; the control plane is unavailable when one of its
        processes exits meanwhile, or when it does not get there in time."""

        def ready() -> Any:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise ControlPlaneUnavailableError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                        + self.log_tail(name)
                    )
            return probe()

        try:
            wait_until(ready, what, limit_s, every_s=0.2)
        except AssertionError as exc:
            raise ControlPlaneUnavailableError(str(exc)) from None

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # -- talking to it ----------------------------------------------------------------

    def _context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))

    def _http_ok(self, url: str, auth: bool = False) -> bool:
        request = urllib.request.Request(url)
        if auth:
            request.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        try:
            with urllib.request.urlopen(
                request, timeout=2, context=self._context() if url.startswith("https") else None
            ) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One call as the cluster admin; returns the decoded answer (raises HTTPError)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10, context=self._context()) as resp:
            return json.loads(resp.read() or b"null")

    def _add_fake_node(self) -> None:
        self.request(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": NODE,
                    "annotations": {
                        "kwok.x-k8s.io/node": "fake",
                        "node.alpha.kubernetes.io/ttl": "0",
                    },
                    "labels": {
                        "kubernetes.io/hostname": NODE,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                    },
                },
                "status": {"allocatable": NODE_CAPACITY, "capacity": NODE_CAPACITY},
            },
        )
        self.wait_for(self._node_ready, 60, f"kwok to make {NODE} Ready")

    def _node_ready(self) -> bool:
        node = self.request("GET", f"/api/v1/nodes/{NODE}")
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def main() -> int:
    with ControlPlane() as plane:
        print(f"export KUBECONFIG={plane.kubeconfig}   # started in {plane.start_seconds:.1f} s")
        print("Ctrl-C stops it.", file=sys.stderr)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal a still-running process's group (each runs in a session of its own)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
