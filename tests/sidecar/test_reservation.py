"""Room held at a migration target: the pure book and rules, the ledger that keeps them,
and a real sidecar's `POST /weir/v1/reserve` — a reservation nobody consumes expires and
its room goes to what waited."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controlplane.contract import FinishReason, KVPolicy, PoolPolicy, SchedulingPolicy
from controlplane.contract import WatermarkState as W
from engine_sidecar.ledger import Flight, Ledger
from engine_sidecar.policy import (
    RESERVED,
    AdmissionVerdict,
    KVUsage,
    PoolOutlook,
    RequestState,
    Reservations,
    SequenceOutlook,
    admits_now,
    decide_admission,
    queued_request,
    reservable_tokens,
)
from engine_sidecar.server import RunningSidecar
from tests.sidecar.conftest import MODEL
from tests.sidecar.test_ledger import flight

S = RequestState
KV = KVPolicy(growth_horizon_steps=16)  # safety: 5 % of capacity
POLICY = PoolPolicy(
    pool="p",
    model="m",
    kv=KV,
    scheduling=SchedulingPolicy(local_queue_size=4, local_queue_max_wait_s=30.0),
)


def test_the_book_holds_consumes_and_expires() -> None:
    book = Reservations("e1")
    a = book.take("req-a", 300, now=10.0, ttl_s=5.0)
    b = book.take("req-b", 200, now=11.0, ttl_s=5.0)
    assert (a.reservation_id, b.reservation_id) == ("e1-1", "e1-2")
    assert (book.held_tokens, len(book), book.next_expiry()) == (500, 2, 15.0)
    assert book.consume(a.reservation_id, "req-b") is None  # another request's: kept
    assert book.consume("e0-1", "req-a") is None  # another book's
    assert book.consume(a.reservation_id, "req-a") == a
    assert book.consume(a.reservation_id, "req-a") is None  # once
    assert book.held_tokens == 200
    assert book.expire(15.9) == []
    assert book.expire(16.0) == [b]
    assert (book.held_tokens, len(book), book.next_expiry()) == (0, 0, None)


def test_room_is_what_admission_would_take_counting_what_is_held() -> None:
    # 1000 tokens, 50 of safety: 950 reservable when empty.
    assert reservable_tokens(KVUsage(1000, 0, 0), W.NORMAL, True, KV) == 950
    assert reservable_tokens(KVUsage(1000, 400, 100), W.NORMAL, True, KV) == 450
    assert reservable_tokens(KVUsage(1000, 0, 0), W.NORMAL, False, KV) == 0  # paused
    assert reservable_tokens(KVUsage(1000, 100, 0), W.CRITICAL, True, KV) == 0


def test_a_continuation_takes_the_room_held_for_it_whatever_the_watermark() -> None:
    """The room was counted as committed when granted: taking it changes no watermark, so
    neither a critical one nor a paused admission keeps it out — only the arithmetic."""
    cont = SequenceOutlook(40, 100, 100)  # grows by 16 (the horizon)
    critical = PoolOutlook(1000, 500, 0, W.CRITICAL, admission_open=False)
    held = decide_admission(cont, 300, critical, KV, held=True)
    assert (held.verdict, held.reason, held.needed_tokens) == (
        AdmissionVerdict.ADMIT,
        RESERVED,
        316,
    )
    assert decide_admission(cont, 300, critical, KV).verdict is AdmissionVerdict.WAIT
    crowded = PoolOutlook(1000, 700, 0, W.NORMAL)  # 250 available: less than it needs
    assert decide_admission(cont, 300, crowded, KV, held=True).verdict is AdmissionVerdict.WAIT
    assert decide_admission(cont, 980, critical, KV, held=True).verdict is AdmissionVerdict.REFUSE
    # It goes in ahead of a queue; a request that merely fits waits behind one.
    fits = decide_admission(cont, 300, PoolOutlook(1000, 0, 0, W.NORMAL), KV)
    assert admits_now(held, waiting=3)
    assert admits_now(fits, waiting=0)
    assert not admits_now(fits, waiting=1)


def test_a_queue_wait_runs_from_when_the_request_joined() -> None:
    """A continuation handed back long after its client arrived waits the pool's local
    wait from its hand-back (cut short by its deadline); one preempted here ages from
    its first arrival."""
    cont = queued_request("c", 1, 500, arrived_at=700.0, now=700.0, max_wait_s=30.0, resumed=True)
    assert (cont.enqueued_at, cont.expires_at, cont.resumed) == (700.0, 730.0, True)
    due = queued_request("d", 1, 500, arrived_at=700.0, now=700.0, max_wait_s=30, deadline_at=710)
    assert due.expires_at == 710.0
    here = queued_request("h", 0, 500, arrived_at=12.0, now=700.0, max_wait_s=30.0)
    assert (here.enqueued_at, here.expires_at) == (12.0, 730.0)


def _flight(rid: str, prompt: int, *, reservation: str = "") -> Flight:
    """A request of `prompt` tokens; with a `reservation`, a continuation naming it."""
    f = flight(rid, prompt)
    f.resumed, f.reservation = bool(reservation), reservation
    return f


async def test_the_ledger_holds_room_for_a_continuation_and_no_one_else_takes_it() -> None:
    """Held room is committed: new work waits while it is held; the continuation it was
    held for goes in at once, past what waits; a continuation that names no reservation
    here (or another request's) queues like any other."""
    now = [0.0]
    events: list[tuple[str, str]] = []
    ledger = Ledger(POLICY, 1000, clock=lambda: now[0])
    ledger.on_reservation = lambda outcome, r: events.append((outcome, r.request_id))
    assert ledger.reserve("moving", 2000, ttl_s=5.0) is None  # more than it has room for
    held = ledger.reserve("moving", 600, ttl_s=5.0)
    assert held is not None
    assert (ledger.held_tokens, ledger.room_tokens()) == (600, 350)
    assert ledger.usage().committed_tokens == 600
    ledger.changed.clear()
    newcomer = _flight("new@1", 400)  # fits the 950 only without the held room
    ledger.add(newcomer)
    waiting = asyncio.create_task(ledger.admit(newcomer))
    await asyncio.sleep(0)
    assert ledger.queued == 1
    stranger = _flight("stranger@1", 450, reservation=held.reservation_id)
    ledger.add(stranger)
    queued_too = asyncio.create_task(ledger.admit(stranger))
    await asyncio.sleep(0)
    assert ledger.queued == 2
    assert ledger.held_tokens == 600
    mover = _flight("moving@1", 500, reservation=held.reservation_id)
    ledger.add(mover)
    await asyncio.wait_for(ledger.admit(mover), 1.0)
    assert mover.record.state is S.PREFILL_READY
    assert mover.admission is not None
    assert mover.admission.reason == RESERVED
    assert ledger.held_tokens == 0
    assert ledger.queued == 2
    assert events == [("refused", "moving"), ("taken", "moving"), ("consumed", "moving")]
    for task in (waiting, queued_too):
        task.cancel()
    await asyncio.gather(waiting, queued_too, return_exceptions=True)
    for f in (newcomer, stranger, mover):
        ledger.move(f, S.CANCELLED, FinishReason.CANCELLED)


async def test_an_unused_reservation_expires_and_its_room_goes_to_what_waits() -> None:
    now = [0.0]
    events: list[str] = []
    ledger = Ledger(POLICY, 1000, clock=lambda: now[0])
    ledger.on_reservation = lambda outcome, r: events.append(outcome)
    held = ledger.reserve("lost", 900, ttl_s=2.0)
    assert held is not None
    assert ledger.watermark is W.CRITICAL
    newcomer = _flight("new@1", 400)
    ledger.add(newcomer)
    waiting = asyncio.create_task(ledger.admit(newcomer))
    await asyncio.sleep(0)
    assert ledger.queued == 1
    now[0] = 2.0  # its time is up: the next look at the book ends it
    late = _flight("lost@1", 600, reservation=held.reservation_id)
    ledger.add(late)
    late_task = asyncio.create_task(ledger.admit(late))
    await asyncio.wait_for(waiting, 1.0)  # the freed room went to the one that waited
    assert newcomer.record.state is S.PREFILL_READY
    assert events == ["taken", "expired"]
    # Too late for its room: it queues as any continuation (616 do not fit beside 416).
    assert late.record.state is S.WAITING_ADMISSION
    assert ledger.held_tokens == 0
    assert ledger.queued == 1
    late_task.cancel()
    await asyncio.gather(late_task, return_exceptions=True)


# -- a served sidecar -------------------------------------------------------------------

RESERVE = "/weir/v1/reserve"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b"{}",
        b'{"request_id": "r", "tokens": 10}',
        b'{"request_id": "", "tokens": 10, "ttl_s": 1}',
        b'{"request_id": "r", "tokens": -5, "ttl_s": 1}',
        b'{"request_id": "r", "tokens": "10", "ttl_s": 1}',
        b'{"request_id": "r", "tokens": true, "ttl_s": 1}',
        b'{"request_id": "r", "tokens": 10, "ttl_s": 0}',
        b'{"request_id": "r", "tokens": 10, "ttl_s": NaN}',
        b'{"request_id": "r", "tokens": 10, "ttl_s": 1e308}',
        b'{"request_id": "r", "tokens": 99999999999999999999, "ttl_s": 1}',
    ],
)
async def test_a_malformed_reservation_is_refused_clearly(
    sidecar: RunningSidecar, body: bytes
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(sidecar.url + RESERVE, data=body) as reply,
    ):
        assert reply.status == 400
        error = (await reply.json())["error"]
    assert error["type"] == "invalid_request"
    assert "RoomReservation" in error["message"]
    assert sidecar.service.ledger.held_tokens == 0


async def test_a_reservation_whose_resume_never_comes_expires_and_frees_its_room(
    sidecar: RunningSidecar,
) -> None:
    """A target holds all its room for a continuation that never arrives (its router
    died, say): a new request waits meanwhile instead of taking the room; when the
    reservation expires the room returns, the request is served, and the metrics and the
    request's story say what happened."""
    ledger = sidecar.service.ledger
    room = ledger.room_tokens()
    ask = {"request_id": "lost-resume", "tokens": room, "ttl_s": 2.0}
    async with aiohttp.ClientSession() as http:
        async with http.post(sidecar.url + RESERVE, json={**ask, "tokens": room + 1}) as reply:
            assert reply.status == 409
            error = (await reply.json())["error"]
        assert (error["reason"], error["room_tokens"]) == ("no_room", room)
        async with http.post(sidecar.url + RESERVE, json=ask) as reply:
            assert reply.status == 200
            granted = await reply.json()
        assert granted["tokens"] == room
        assert granted["reservation_id"]
        async with http.get(sidecar.url + "/weir/v1/state") as reply:
            state = await reply.json()
        assert state["held_for_migrations_tokens"] == room
        assert state["watermark"] == "exhausted"  # held room is committed room
        body = {"model": MODEL, "text": "hello", "sampling_params": {"max_new_tokens": 8}}
        async with http.post(sidecar.url + "/generate", json=body) as reply:
            assert reply.status == 200
            request_id = reply.headers["x-request-id"]
            await reply.read()
        async with http.get(sidecar.url + "/metrics") as reply:
            metrics = await reply.text()
        async with http.get(sidecar.url + f"/weir/v1/requests/{request_id}") as reply:
            story = await reply.json()
        async with http.get(sidecar.url + "/weir/v1/requests/lost-resume") as reply:
            reservation_story = await reply.json()
    held_events = reservation_story["events"]
    assert [e["event"] for e in held_events] == [
        "reservation_refused", "reservation_taken", "reservation_expired",
    ]  # fmt: skip
    admitted = next(e for e in story["events"] if e["event"] == "admitted")
    assert admitted["at"] >= held_events[-1]["at"]  # it went in once the room returned
    assert ledger.held_tokens == 0
    endpoint = sidecar.service.metrics.endpoint
    for outcome, count in (("taken", 1), ("refused", 1), ("expired", 1), ("consumed", 0)):
        labels = f'endpoint="{endpoint}",outcome="{outcome}",pool="p"'
        assert f"weir_sidecar_migration_reservations_total{{{labels}}} {count}.0" in metrics
