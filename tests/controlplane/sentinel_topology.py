"""A real master, replica and redis-sentinel on loopback, for failover tests."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from weir.local.ports import free_port, wait_for_port
from weir.local.process import LocalService, stop_process
from weir.local.redis_server import RedisNotInstalledError, RedisServer

SERVICE = "weir"


class SentinelTopology(LocalService):
    """master + one replica + one sentinel (quorum 1) that fails over half a second after
    the master stops answering; with `password`, master and replica require it (AUTH) and
    the sentinel uses it to watch them."""

    def __init__(self, password: str = "") -> None:
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        self.password = password
        self.master = RedisServer(extra_args=auth)
        self.replica_port = free_port()
        self.replica = RedisServer(self.replica_port, extra_args=auth)
        self.sentinel_port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="weir-sentinel-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelTopology:
        self.master.start()
        self.replica.extra_args += ("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.start()
        conf = Path(self._dir.name) / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\n"
            "bind 127.0.0.1\n"
            f"dir {self._dir.name}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 500\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel known-replica {SERVICE} 127.0.0.1 {self.replica_port}\n"
            + (f"sentinel auth-pass {SERVICE} {self.password}\n" if self.password else "")
        )
        binary = shutil.which("redis-sentinel")
        if binary is None:
            raise RedisNotInstalledError(
                "redis-sentinel is not installed; run scripts/bootstrap.sh "
                "(apt-get install redis-sentinel)"
            )
        self._proc = subprocess.Popen(
            [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.sentinel_port)
        return self

    @property
    def url(self) -> str:
        """The URL Weir's components take for this topology."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+sentinel://{auth}127.0.0.1:{self.sentinel_port}/{SERVICE}"

    def close(self) -> None:
        stop_process(self._proc)
        self._proc = None
        self.replica.close()
        self.master.close()
        self._dir.cleanup()
