"""The store on a real Redis Cluster while the pool's hash slot changes hands: migrated to
another primary key by key, or taken over by a replica when its primary is killed. The
store stays in use throughout, as a pool's router and sidecars use it: leases beating, a
follower on the change feed, quota charges and releases. Store calls may fail while the
slot moves (a script whose keys are split between two nodes cannot run; a dead primary
answers nothing); afterwards everything resumes, no charge is lost or counted twice, and
nothing leaks. How long the slot was unusable is printed, not asserted."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.exceptions import RedisError

from controlplane.contract import Command, CommandKind, TenantQuota
from controlplane.store import (
    Amounts,
    CommandChannel,
    EndpointLease,
    EndpointRegistry,
    PoolFollower,
    PoolKeys,
    QuotaHolder,
    QuotaStore,
    RedisClient,
    RedisSettings,
    cancel_loops,
    connect,
)
from tests.controlplane.cluster_topology import ClusterTopology, running_cluster
from tests.controlplane.records import POOL, endpoint
from tests.polling import until

pytestmark = pytest.mark.redis
TENANT = "t"
WORKERS = 4
STATE_KEY = PoolKeys(POOL).state  # any key of the pool: they share its slot


@pytest.fixture(scope="module")
def topology() -> Iterator[ClusterTopology]:
    """A cluster of this module's own: its tests move slots and kill nodes."""
    with running_cluster(password="weir-moves") as cluster:
        yield cluster


@pytest.fixture
async def client(topology: ClusterTopology) -> AsyncIterator[RedisClient]:
    await asyncio.to_thread(topology.flush)
    redis = connect(RedisSettings.from_url(topology.url, retries=2, connect_timeout_s=0.5))
    yield redis
    await redis.aclose()


class StoreInUse:
    """Two endpoints beating their leases, a follower watching the change feed, and
    workers charging a tenant's quota under one holder, each releasing its previous
    charge once the next one is granted. A failed call is counted and tried again, as
    the router and the sidecars do."""

    def __init__(self, client: RedisClient) -> None:
        self.registry = EndpointRegistry(client, POOL)
        self.quotas = QuotaStore(client, POOL)
        self.holder = QuotaHolder(self.quotas, "router-1", lease_ttl_s=30)
        self.states = [endpoint("e0"), endpoint("e1")]
        self.leases = [EndpointLease(self.registry, ttl_s=30) for _ in self.states]
        self.follower = PoolFollower(self.registry)
        self.failed: Counter[str] = Counter()
        self.granted = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        await self.quotas.set_quota(TenantQuota(name=TENANT, max_concurrency=1000))
        await self.holder.renew()
        self._tasks = [
            *(
                asyncio.create_task(lease.run(lambda s=state: s, 0.05))
                for lease, state in zip(self.leases, self.states, strict=True)
            ),
            asyncio.create_task(self._follow()),
            *(asyncio.create_task(self._charge(w)) for w in range(WORKERS)),
        ]
        await self.resumes("the start")

    async def resumes(self, after: str) -> None:
        """Until more charges are granted and every lease beats a few more times."""
        granted, versions = self.granted, [lease.version for lease in self.leases]
        await until(lambda: self.granted >= granted + 5 * WORKERS, f"charges after {after}", 60)
        await until(
            lambda: all(
                lease.version >= version + 5
                for lease, version in zip(self.leases, versions, strict=True)
            ),
            f"heartbeats after {after}",
            60,
        )

    async def _follow(self) -> None:
        async for _snapshot in self.follower.watch(block_s=0.2):
            pass

    async def _charge(self, worker: int) -> None:
        held, i = "", 0
        while not self._stopping:  # a cancel may be lost in the client (see cancel_loops)
            request_id, i = f"w{worker}-{i}", i + 1
            try:
                result = await self.holder.charge(TENANT, request_id, Amounts(concurrency=1))
            except (RedisError, OSError) as exc:
                self.holder.forget(request_id)
                self.failed[type(exc).__name__] += 1
                await asyncio.sleep(0.02)
                continue
            if not result.granted:
                self.failed[f"refused: {result.reason}"] += 1
                continue
            self.granted += 1
            if held and not await self.holder.release(held):
                self.failed["release kept for later"] += 1
            held = request_id

    async def stop(self) -> None:
        self._stopping = True
        await cancel_loops(self._tasks)
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                raise AssertionError(f"{task.get_name()} failed") from task.exception()

    async def settle(self) -> None:
        """Send what the holder kept, and reconcile, until Redis takes it all."""

        async def settled() -> bool:
            try:
                await self.holder.settle()
            except (RedisError, OSError):
                return False
            return True

        await until(settled, "the holder to settle", timeout_s=30)

    async def check_and_empty(self) -> frozenset[str]:
        """After `stop`: the store holds no charge the holder does not know of and counts
        each once, and the follower's view and every lease agree with the store; then
        every charge is released and the tenant's usage is back to zero. Returns the
        requests the holder had charged that the store does not hold (lost)."""
        await self.settle()
        held = await self.quotas.held(self.holder.name)
        assert held <= self.holder.in_flight
        assert (await self.quotas.usage(TENANT)).concurrency == len(held)
        await self.follower.refresh()
        stored = await self.registry.snapshot()
        assert {e: s.version for e, s in self.follower.snapshot.endpoints.items()} == {
            e: s.version for e, s in stored.endpoints.items()
        }
        for lease in self.leases:
            assert stored.endpoints[lease.endpoint_id].version == lease.version
        lost = frozenset(self.holder.in_flight) - held
        for request_id in sorted(self.holder.in_flight):
            await self.holder.release(request_id)
        await self.settle()
        assert await self.quotas.held(self.holder.name) == frozenset()
        assert (await self.quotas.usage(TENANT)).concurrency == 0
        assert self.holder.pending == 0
        return lost


async def _send_and_receive(client: RedisClient, command_id: str) -> list[str]:
    """Send a command to e0; return the ids e0's sidecar receives (and acknowledges)."""
    channel = CommandChannel(client, POOL)
    await channel.send(
        Command(command_id=command_id, pool=POOL, endpoint_id="e0", kind=CommandKind.DRAIN)
    )
    received = await channel.receive("e0", "sidecar-e0")
    for delivery in received:
        await channel.ack("e0", delivery.entry_id)
    return [delivery.command.command_id for delivery in received]


async def test_the_pool_s_slot_migrates_to_another_primary_while_in_use(
    topology: ClusterTopology, client: RedisClient
) -> None:
    store = StoreInUse(client)
    await store.start()
    await CommandChannel(client, POOL).send(
        Command(command_id="c-before", pool=POOL, endpoint_id="e0", kind=CommandKind.DRAIN)
    )
    source = topology.owner(STATE_KEY)
    target = next(node for node in topology.primaries() if node is not source)
    epochs = [lease.epoch for lease in store.leases]
    incarnation = store.follower.position.incarnation
    started = time.monotonic()
    # Key by key, the store's calls landing in between, while the slot is half moved.
    moved = await asyncio.to_thread(
        topology.migrate_slot, STATE_KEY, target, lambda: time.sleep(0.05)
    )
    took = time.monotonic() - started
    assert topology.owner(STATE_KEY) is target
    await store.resumes("the move")
    await store.stop()
    print(f"\nslot migration: {moved} keys moved in {took:.2f}s; store calls failed meanwhile: "
          f"{dict(store.failed) or 'none'}")  # fmt: skip
    assert await store.check_and_empty() == frozenset()  # every key went over whole
    assert [lease.epoch for lease in store.leases] == epochs
    assert all(lease.registrations == 1 for lease in store.leases)
    assert store.follower.position.incarnation == incarnation
    assert await _send_and_receive(client, "c-after") == ["c-before", "c-after"]


async def test_the_pool_s_primary_is_killed_and_its_replica_takes_over(
    topology: ClusterTopology, client: RedisClient
) -> None:
    store = StoreInUse(client)
    await store.start()
    primary = topology.owner(STATE_KEY)
    replica = topology.replica_of(primary)
    await asyncio.to_thread(primary.kill)
    killed = time.monotonic()

    async def served() -> bool:
        try:
            await store.quotas.renew_holder("probe", 5)
        except (RedisError, OSError):
            return False
        return True

    await until(served, "the pool's slot served again", timeout_s=60)
    recovered_s = time.monotonic() - killed

    async def replica_owns_it() -> bool:
        return await asyncio.to_thread(topology.owner, STATE_KEY) is replica

    # The node asked may learn of the promotion by gossip after the client did (MOVED).
    await until(replica_owns_it, "the cluster to name the replica the slot's owner", timeout_s=10)
    await store.resumes("the failover")
    await store.stop()
    # Replication is asynchronous: a charge the primary granted just before it died may
    # be missing on the replica. Then it is lost, never leaked.
    lost = await store.check_and_empty()
    print(f"\nprimary failover: the pool's slot answered again {recovered_s:.2f}s after the kill; "
          f"store calls failed meanwhile: {dict(store.failed) or 'none'}; charges lost with "
          f"the primary's last writes: {len(lost)}; lease registrations: "
          f"{[lease.registrations for lease in store.leases]}")  # fmt: skip
    assert await _send_and_receive(client, "c-after") == ["c-after"]
    # The old primary comes back as its replica's replica: the cluster is whole again.
    await asyncio.to_thread(primary.start)
    await asyncio.to_thread(topology.wait_healthy)
    assert topology.replica_of(replica) is primary
