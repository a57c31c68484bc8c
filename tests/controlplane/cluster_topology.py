"""A real Redis Cluster on loopback: three primaries, one replica each, made by
`redis-cli --cluster create`, for the store's tests on a cluster, a slot migration and a
primary failover."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import redis

from tests.polling import wait_until
from tests.tiers import unavailable
from weir.local.ports import free_port
from weir.local.process import LocalService
from weir.local.redis_server import RedisNotInstalledError, RedisServer

PRIMARIES = 3


class ClusterTopology(LocalService):
    """Six `redis-server --cluster-enabled yes` processes joined into a cluster.

    `node_timeout_ms` is how long a primary may stay silent before its replica takes over
    (plus the replica's election delay, about a second): short, so that a failover test is
    quick, yet long enough that a loaded test machine does not fail over by itself. With
    `password`, every node requires it and replicas use it to sync."""

    def __init__(self, password: str = "", node_timeout_ms: int = 1500) -> None:
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        self.password = password
        options = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            # A replica takes over however long its link was down: the tests kill
            # primaries on purpose.
            "--cluster-replica-validity-factor", "0",
            # Replicas sync at once, not after the default 5 s wait for others.
            "--repl-diskless-sync-delay", "0",
            *auth,
        )  # fmt: skip
        # A client port and a bus port per node (the bus's default, the client port +
        # 10000, may be taken or out of range), all different.
        ports: set[int] = set()
        while len(ports) < 4 * PRIMARIES:
            ports.add(free_port())
        free = iter(ports)
        self.nodes = [
            RedisServer(next(free), extra_args=("--cluster-port", str(next(free)), *options))
            for _ in range(2 * PRIMARIES)
        ]

    def start(self) -> ClusterTopology:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisNotInstalledError(
                "redis-cli is not installed; run scripts/bootstrap.sh (apt-get install redis-tools)"
            )
        for node in self.nodes:
            node.start()
        auth = ("--no-auth-warning", "-a", self.password) if self.password else ()
        subprocess.run(
            [cli, *auth, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_healthy()
        return self

    @property
    def url(self) -> str:
        """The URL Weir's components take: two of the nodes to discover the cluster from."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(
            f"127.0.0.1:{node.port}" for node in self.nodes[:2]
        )

    def ask(self, node: RedisServer, *command: str | int) -> Any:
        """One command to one node (its reply as is: a MOVED is an error here)."""
        client = redis.Redis(port=node.port, password=self.password or None)
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def node_id(self, node: RedisServer) -> str:
        return str(self.ask(node, "CLUSTER", "MYID").decode())

    def running(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.running]

    def primaries(self) -> list[RedisServer]:
        return [node for node in self.running() if self.ask(node, "ROLE")[0] == b"master"]

    def slot(self, key: str) -> int:
        return int(self.ask(self.running()[0], "CLUSTER", "KEYSLOT", key))

    def owner(self, key: str) -> RedisServer:
        """The primary serving `key`'s slot, as the cluster says now."""
        slot = self.slot(key)
        for first, last, primary, *_replicas in self.ask(self.running()[0], "CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return self._at(int(primary[1]))
        raise LookupError(f"no node serves slot {slot}")

    def replica_of(self, primary: RedisServer) -> RedisServer:
        _role, _offset, replicas = self.ask(primary, "ROLE")
        return self._at(int(replicas[0][1]))

    def _at(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def flush(self) -> None:
        """Delete every key (on the primaries; replicas follow)."""
        for node in self.primaries():
            self.ask(node, "FLUSHALL")

    def migrate_slot(
        self, key: str, target: RedisServer, between_keys: Callable[[], None] = lambda: None
    ) -> int:
        """Move `key`'s slot to the primary `target` as `redis-cli --cluster reshard`
        does, one key at a time, calling `between_keys` after each (while the slot is half
        moved); the slot's new owner is then announced to every primary. Returns the
        number of keys moved."""
        slot, source = self.slot(key), self.owner(key)
        source_id, target_id = self.node_id(source), self.node_id(target)
        self.ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self.ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        auth = ("AUTH", self.password) if self.password else ()
        moved = 0
        while keys := self.ask(source, "CLUSTER", "GETKEYSINSLOT", slot, 1):
            self.ask(source, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, *auth, "KEYS",
                     *keys)  # fmt: skip
            moved += len(keys)
            between_keys()
        for node in (target, source, *self.primaries()):
            self.ask(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        return moved

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node says the cluster is ok and agrees on who serves which
        slots, and every replica's link to its primary is up."""

        def healthy() -> bool:
            try:
                views = set()
                for node in self.running():
                    info = self.ask(node, "CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info:
                        return False
                    role = self.ask(node, "ROLE")
                    if role[0] == b"slave" and role[3] != b"connected":
                        return False
                    views.add(repr(sorted(self.ask(node, "CLUSTER", "SLOTS"))))
                return len(views) == 1
            except redis.RedisError:
                return False

        wait_until(healthy, "every node ok, in agreement, every replica in sync", timeout_s)

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@contextlib.contextmanager
def running_cluster(password: str = "") -> Iterator[ClusterTopology]:
    """A started cluster, closed afterwards; without redis-cli the Redis Cluster tier
    skips here and fails in CI."""
    with contextlib.ExitStack() as stack:
        try:
            topology = stack.enter_context(ClusterTopology(password))
        except RedisNotInstalledError as exc:
            unavailable("Redis Cluster", str(exc))
        yield topology
