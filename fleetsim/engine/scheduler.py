"""The engine model: SGLang's scheduler, stepping one iteration at a time on a caller's clock.

Nothing here reads a clock or does I/O: `now` comes in, an iteration's duration (from the
roofline timing model) goes out. The HTTP server sleeps that duration (over its speed
factor) in real time; the fleet simulator adds it to virtual time.

One iteration, as SGLang's `Scheduler.get_next_batch_to_run` (sglang/srt/managers/
scheduler.py) and `PrefillAdder` (schedule_policy.py, mem_cache/prefill_budget.py) do it:
1. admission: the request mid-way through a chunked prefill takes its next chunk; then
   waiting requests, in policy order, are admitted while `available + evictable − offset`
   stays above their uncached history plus clipped remaining max-new-tokens (plus a page
   on 0.5.23). The offset is Σ over decoding requests of `min(max_new − generated, 4096) ×
   new_token_ratio` (ratio 1 for `ignore_eos` on 0.5.23), plus, for each request admitted
   in this pass, its page-rounded extend, a page (0.5.23) and its whole clipped
   max-new-tokens. The pass stops at the first request that does not fit, at the running
   limit, or when the chunk budget (`chunked_prefill_size`) or `max_prefill_tokens` is
   spent; the request that overflows the chunk budget is cut at a page boundary and
   becomes the one chunked request. A request that does not fit sets `batch_is_full`:
   nothing new is admitted until a running request leaves.
2. prefill: admitted requests compute the chunk admission planned for them (with
   `prefill_yield`, the iteration's token budget is shared out instead). A request that
   reaches the end of its history samples its first token and joins decode.
3. decode (in the same iteration with `enable_mixed_chunk`, else only when there was no
   prefill): every decoding request writes the KV of its last token and samples one more.
   When the pages for that do not exist, requests are retracted — fewest output tokens
   first — until they do: their KV is freed without entering the prefix cache, they
   rejoin the tail of the queue, and the new-token ratio is re-estimated from what the
   requests kept have decoded.

P/D decode side (SGLang's `DecodePreallocQueue` and `DecodeTransferQueue`,
sglang/srt/disaggregation/decode.py): a handed-off request (`submit_handoff`) waits, first
come first served, until `preallocate` finds the pool can receive its prompt's KV without
overcommitting the requests already there, takes pages for it and holds them while the
KV travels; `kv_arrived` gives it the prefill's first token, and it joins the running
requests with its prompt's KV placed, not computed. A prefill engine needs nothing here:
its requests ask for one token.

P/D prefill side (SGLang's `PrefillBootstrapQueue` and inflight queue, prefill.py): a
request to export (`submit_prefill`) waits until its decode peer has pages for its KV
(`peer_ready`), queues and prefills as any request, and after its first token holds its
KV while the transfer runs (`StepResult.exported`); `transfer_done` then finishes it
with SGLang's `length 0` and its pages go to the prefix cache.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from fleetsim.engine.backends import HashBackend, TokenBackend
from fleetsim.engine.config import CLIP_MAX_NEW_TOKENS, EngineConfig
from fleetsim.engine.host_cache import HostCache
from fleetsim.engine.kv_cache import KVCache
from fleetsim.engine.request import EngineRequest, Finish, Phase, aborted
from fleetsim.engine.tokens import (
    EOS_ID,
    TOKEN_BYTES,
    VOCAB_SIZE,
    TokenFunction,
    byte_ids,
    decode,
    prefix_hash,
)

_crc32 = zlib.crc32

# SGLANG_RETRACT_DECODE_STEPS: decode steps of headroom a retraction frees per request kept,
# and the steps credited to each in the new-token-ratio estimate after a retraction.
RETRACT_DECODE_STEPS: Final = 20
# LPM sorts at most this many waiting requests; beyond, the queue is served in order.
LPM_MAX_WAITING: Final = 128
# LPM's in-batch prefix caching: a request with at most this many tokens cached waits
# behind an earlier waiting request that shares its first this-many tokens.
IN_BATCH_PREFIX_TOKENS: Final = 32
# Admission results (SGLang's AddReqResult).
_CONTINUE, _NO_TOKEN, _OTHER = "continue", "no_token", "other"


class EngineRequestError(ValueError):
    """A request the engine refuses outright (SGLang answers these with 400)."""


@dataclass(slots=True)
class StepResult:
    """What one iteration did. `admitted` left the queue for a prefill; `emitted` got
    exactly one new token each (its last `output_ids` entry); `finished` ended this step
    (also listed in `emitted` when their final token came this step); `retracted` lost
    their KV and wait for recompute."""

    duration: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    admitted: list[EngineRequest] = field(default_factory=list)
    emitted: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    retracted: list[EngineRequest] = field(default_factory=list)
    # P/D prefill side: computed their first token (in `emitted` too); their KV ships now.
    exported: list[EngineRequest] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_tokens == 0


@dataclass(frozen=True, slots=True)
class Loads:
    """The scheduler's load, in SGLang's /v1/loads vocabulary."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    num_evictable_tokens: int
    num_available_tokens: int
    max_total_num_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    new_token_ratio: float
    num_retracted_reqs: int
    paused: bool
    # P/D decode side: waiting for pages, holding pages while the KV travels.
    num_prealloc_reqs: int = 0
    num_transfer_reqs: int = 0
    # P/D prefill side: waiting for their decode peer, holding KV while it ships.
    num_bootstrap_reqs: int = 0
    num_inflight_reqs: int = 0


@dataclass(slots=True)
class _PrefillBudget:
    """One admission pass's reservations, as SGLang's PrefillBudget and PrefillAdder keep
    them: `total_offset` holds what admitted and running requests may still grow into,
    `current_offset` what this pass allocates now."""

    kv: KVCache
    page_size: int
    page_charge: int  # the page 0.5.23 adds per admitted request
    total_offset: float
    current_offset: float
    rem_input: int
    rem_chunk: int | None

    @property
    def remaining_total(self) -> float:
        return self.kv.available_pages * self.page_size - self.total_offset

    @property
    def remaining_current(self) -> float:
        return self.kv.available_pages * self.page_size - self.current_offset

    def paged(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def reserve(self, extend: int, compute: int, max_new: int) -> None:
        """Charge an admission: `extend` tokens of KV now, `compute` of them computed,
        `max_new` more tokens of KV later."""
        now = self.paged(extend) + self.page_charge
        self.total_offset += now + max_new
        self.current_offset += now
        charged = self.paged(compute)
        self.rem_input -= charged
        if self.rem_chunk is not None:
            self.rem_chunk -= charged

    def state(self) -> str:
        if self.remaining_total <= 0 or self.remaining_current <= 0:
            return _NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return _OTHER
        return _CONTINUE


class EngineModel:
    """SGLang's scheduler over a KV pool. See the module docstring for one iteration."""

    def __init__(self, config: EngineConfig, backend: TokenBackend | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.total_tokens = config.total_tokens
        self.context_len = config.context_len
        self.host = (
            HostCache(config.host_total_tokens // self.page_size, self.page_size)
            if config.enable_hierarchical_cache
            else None
        )
        self.kv = KVCache(
            self.total_tokens // self.page_size,
            self.page_size,
            prefix_cache=not config.disable_radix_cache,
            host=self.host,
            write_through=config.hicache_write_policy == "write_through",
        )
        self.backend: TokenBackend = backend or HashBackend(TokenFunction(config.eos_per_mille))
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []
        self.prefilling: list[EngineRequest] = []
        self.decoding: list[EngineRequest] = []
        self.paused = False
        self.batch_is_full = False
        self.v0523 = config.sglang_version == "0.5.23"
        self.init_ratio = config.init_new_token_ratio
        self.min_ratio = config.init_new_token_ratio * config.min_new_token_ratio_factor
        self.ratio_decay = (self.init_ratio - self.min_ratio) / max(
            1, config.new_token_ratio_decay_steps
        )
        self.new_token_ratio = self.init_ratio
        self.prefill_budget = (
            config.chunked_prefill_size if config.chunked_prefill_size > 0 else math.inf
        )
        self.time_budget = config.prefill_time_budget_s
        # cumulative counters, for readers of the model (simulator reports, tests)
        self.steps = 0
        self.decode_steps = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.aborted_total = 0
        self.retracted_total = 0
        self.imported_tokens_total = 0
        self._last_retracted = 0
        self._tp_window: tuple[float | None, int] = (None, 0)
        self.gen_throughput = 0.0
        # SGLang's load report: decode steps' moments (count, Σ batch, Σ µs, Σ batch²,
        # Σ batch·µs, Σ tokens) and the µs spent in iterations that prefilled.
        self.decode_moments = [0.0] * 6
        self.prefill_busy_us = 0
        self._firsts: list[EngineRequest] = []
        # Requests a submit ended (evicted from a full queue), reported by the next step.
        self._ended: list[EngineRequest] = []
        self.prealloc: list[EngineRequest] = []
        self.transferring: list[EngineRequest] = []
        self.bootstrapping: list[EngineRequest] = []
        self.inflight: list[EngineRequest] = []
        self._host_copied = 0  # host tier tokens copied, as of the last iteration

    # -- requests in -----------------------------------------------------------------
    def make_request(
        self,
        rid: str,
        input_ids: Sequence[int],
        max_new_tokens: int | None,
        *,
        ignore_eos: bool = False,
        min_new_tokens: int = 0,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        priority: int = 0,
        cache_salt: str = "",
        kv_imported: int = 0,
        now: float = 0.0,
    ) -> EngineRequest:
        """A validated request. Raises EngineRequestError with SGLang's message on bad input;
        `max_new_tokens=None` means "as many as fit".

        As SGLang's scheduler does on arrival (`init_req_max_new_tokens`), max_new_tokens
        is clipped so that the request fits the context, and on 0.5.23 an empty pool:
        whatever it asked for, a request admitted alone always runs to its end.

        `kv_imported` (P/D decode side): the KV of the first `kv_imported` tokens was
        computed by a prefill engine and arrives by transfer, so admission still needs
        pages for them but no iteration computes them. At least the last token of the
        history is computed here, to sample the next one. (With the hash backend, tokens
        depend only on the history, so an imported request continues exactly as the
        uninterrupted one; a backend holding real KV content has nothing to import.)"""
        if not input_ids:
            raise EngineRequestError("The input must not be empty.")
        n = len(input_ids)
        if n >= self.context_len:
            raise EngineRequestError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        raw = byte_ids(input_ids)  # one C pass; the same object when given bytes
        if raw is None:  # else every id is in the vocabulary
            low, high = min(input_ids), max(input_ids)
            if low < 0 or high >= VOCAB_SIZE:
                bad = low if low < 0 else high
                raise EngineRequestError(
                    f"Token id {bad} is out of the vocabulary (0..{VOCAB_SIZE - 1})."
                )
        if max_new_tokens is not None and max_new_tokens < 0:
            raise EngineRequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if max_new_tokens is not None and n + max_new_tokens > self.context_len:
            raise EngineRequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {n + max_new_tokens} "
                f"tokens: {n} tokens from the input messages and {max_new_tokens} tokens "
                f"for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit."
            )
        limit = self.config.max_req_input_len
        if n >= limit:
            raise EngineRequestError(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} "
                f"tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        if not 0 <= kv_imported < n:
            raise EngineRequestError(f"kv_imported must be in [0, {n}), got {kv_imported}.")
        wanted = self.context_len if max_new_tokens is None else max_new_tokens
        if min_new_tokens < 0 or min_new_tokens > wanted:
            raise EngineRequestError(
                f"min_new_tokens must be in [0, max_new_tokens={wanted}], got {min_new_tokens}."
            )
        clipped = max(0, min(wanted, self.config.max_req_len - n - 1))
        if self.v0523:
            ps = self.page_size
            clipped = max(0, min(clipped, self.total_tokens - -(-n // ps) * ps - ps - 1))
        return EngineRequest(
            rid=rid,
            input_ids=list(input_ids),
            max_new_tokens=clipped,
            ignore_eos=ignore_eos,
            min_new_tokens=min(min_new_tokens, clipped),
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(stop_token_ids),
            priority=priority,
            cache_salt=cache_salt,
            arrival=now,
            kv_imported=kv_imported,
            prompt_hash=prefix_hash(input_ids if raw is None else raw),
        )

    def submit(self, req: EngineRequest, now: float) -> bool:
        """Queue a request. False when the queue is full: the request then is finished
        with SGLang's 503 abort and never touches the pool. With priority scheduling a
        full queue drops its least preferred request instead, if the newcomer is
        preferred to it; the next step reports that one among its finished."""
        if req.rid in self.requests:
            raise EngineRequestError(f"Duplicate request ID detected: {req.rid}")
        req.arrival = now
        req.hash_state = prefix_hash(req.output_ids, req.prompt_hash)
        self.requests[req.rid] = req
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        victim = self._enqueue(req, now)
        if victim is req:
            self.requests_total -= 1
            self.prompt_tokens_total -= len(req.input_ids)
            return False
        if victim is not None:
            self._ended.append(victim)
        return True

    def submit_prefill(self, req: EngineRequest, now: float) -> None:
        """P/D prefill side: a request whose KV goes to a decode engine. It waits for
        `peer_ready` before it queues; after its first token it keeps its KV until
        `transfer_done`."""
        if req.rid in self.requests:
            raise EngineRequestError(f"Duplicate request ID detected: {req.rid}")
        req.arrival = req.queued_at = now
        req.kv_export = True
        req.phase = Phase.BOOTSTRAP
        self.requests[req.rid] = req
        self.bootstrapping.append(req)

    def peer_ready(self, req: EngineRequest, now: float) -> bool:
        """Its decode peer has pages for the KV: the request queues for prefill. False
        when a full queue refused it (it is then finished with the 503 abort)."""
        if req.phase is not Phase.BOOTSTRAP:
            raise EngineRequestError(
                f"request {req.rid} is not waiting for its peer ({req.phase.value})"
            )
        self.bootstrapping.remove(req)
        del self.requests[req.rid]
        arrival = req.arrival
        queued = self.submit(req, now)
        req.arrival = arrival  # its latency counts from its arrival, not from its peer's
        return queued

    def transfer_done(self, req: EngineRequest, now: float) -> None:
        """Its KV has reached the decode engine: the request ends (SGLang's `length 0`)
        and its pages go to the prefix cache."""
        if req.phase is not Phase.INFLIGHT:
            raise EngineRequestError(f"request {req.rid} is not transferring ({req.phase.value})")
        self._finish(req, Finish("length", length=0), now)

    def submit_handoff(self, req: EngineRequest, now: float) -> None:
        """P/D decode side: a request whose prompt's KV and first token a prefill engine
        computes. It waits for `preallocate` to give it pages, then for `kv_arrived`."""
        if req.rid in self.requests:
            raise EngineRequestError(f"Duplicate request ID detected: {req.rid}")
        req.arrival = req.queued_at = now
        req.kv_imported = len(req.input_ids)
        req.hash_state = req.prompt_hash
        req.phase = Phase.PREALLOC
        self.requests[req.rid] = req
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        self.prealloc.append(req)

    def preallocate(self) -> list[EngineRequest]:
        """Give waiting handed-off requests pages for their prompts' KV, first come first
        served, while the pool can take each without overcommitting (SGLang's
        `pop_preallocated`): what may be allocated is what is available less, for every
        request there, `num_reserved_decode_tokens` of decode room (or the largest running
        request's remaining need, if more), and a request needs its prompt's pages plus
        that reserve, or its prompt and clipped max-new-tokens less what the running
        requests could give back, whichever is more. Returns the requests now waiting for
        their KV."""
        moved: list[EngineRequest] = []
        if self.paused:
            return moved
        kv, ps = self.kv, self.page_size
        reserve = self.config.num_reserved_decode_tokens
        retractable = sum(r.total_len for r in self.decoding)
        largest_need = max(
            (
                min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS) + r.prompt_tokens - retractable
                for r in self.decoding
            ),
            default=0,
        )
        while self.prealloc:
            req = self.prealloc[0]
            active = (
                len(self.decoding) + len(self.prefilling) + len(self.waiting)
                + len(self.transferring)
            )  # fmt: skip
            allocatable = kv.available_pages * ps - max(reserve * active, largest_need)
            pages = -(-req.kv_imported // ps)
            required = max(
                pages * ps + reserve,
                req.kv_imported + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) - retractable,
            )
            got = kv.allocate(pages) if required <= allocatable else None
            if got is None:
                break
            req.pages = got
            req.phase = Phase.TRANSFER
            self.prealloc.pop(0)
            self.transferring.append(req)
            moved.append(req)
        return moved

    def kv_arrived(
        self, req: EngineRequest, output_id: int, cached_tokens: int, now: float
    ) -> None:
        """The prompt's KV has landed in the pages `preallocate` gave the request, with the
        prefill engine's first token: that token is its first output, and it joins the
        running requests to compute the next (SGLang's prebuilt batch), unless the token
        already ends it (then it is finished)."""
        if req.phase is not Phase.TRANSFER:
            raise EngineRequestError(
                f"request {req.rid} is not waiting for its KV ({req.phase.value})"
            )
        req.cached_tokens = cached_tokens
        req.first_token_at = now
        req.output_ids.append(output_id)
        req.hash_state = _crc32(TOKEN_BYTES[output_id], req.hash_state)
        self.generation_tokens_total += 1
        if self._check_finish(req, output_id, now):
            return
        self.transferring.remove(req)
        req.phase = Phase.PREFILL
        req.prefill_end = req.total_len
        req.admitted_at = now
        self.prefilling.append(req)

    def _enqueue(self, req: EngineRequest, now: float) -> EngineRequest | None:
        """Put a request at the tail of the queue (SGLang's _add_request_to_queue). Over
        `max_queued_requests`, one request is finished with a 503 abort and returned: the
        newcomer, or with priority scheduling the least preferred waiting request (the
        newest among equals) when the newcomer is strictly preferred to it."""
        req.phase = Phase.WAITING
        req.queued_at = now
        cfg = self.config
        limit = cfg.max_queued_requests
        if limit is None or len(self.waiting) < limit:
            self.waiting.append(req)
            return None
        victim, message = req, "The request queue is full."
        if cfg.enable_priority_scheduling and self.waiting:
            direction = 1 if cfg.schedule_low_priority_values_first else -1
            worst = max(self.waiting, key=lambda r: (direction * r.priority, r.queued_at))
            if direction * req.priority < direction * worst.priority:
                victim, message = worst, "The request is aborted by a higher priority request."
        self.waiting.append(req)
        self._finish(victim, aborted(message, 503), now)
        self.aborted_total += 1
        return victim

    # -- control -----------------------------------------------------------------------
    def abort(
        self,
        rid: str = "",
        *,
        abort_all: bool = False,
        now: float = 0.0,
        message: str = "Aborted",
    ) -> list[EngineRequest]:
        """SGLang's scheduler-side abort: every live request whose rid starts with `rid`
        (or all). An empty rid without `abort_all` aborts nothing; unknown rids are
        ignored. (Over HTTP, SGLang's tokenizer forwards an abort only for a live exact
        rid: the server checks that before calling this.)"""
        if abort_all:
            victims = list(self.requests.values())
        elif rid:
            victims = [r for r in self.requests.values() if r.rid.startswith(rid)]
        else:
            return []
        for req in victims:
            self._finish(req, aborted(message), now)
        self.aborted_total += len(victims)
        return victims

    def abort_request(
        self,
        req: EngineRequest,
        now: float,
        message: str = "Aborted",
        status_code: int | None = None,
    ) -> list[EngineRequest]:
        """Abort exactly this request (a client that went away, or a failed P/D handoff
        with its status); [] if already over."""
        if req.finish is not None or self.requests.get(req.rid) is not req:
            return []
        self._finish(req, aborted(message, status_code), now)
        self.aborted_total += 1
        return [req]

    def pause(self, mode: str, now: float) -> list[EngineRequest]:
        """SGLang's /pause_generation: `abort` ends every request, `retract` frees every
        running request's KV and requeues it at the tail, `in_place` just stops stepping.
        Returns the requests that ended (aborted, or dropped by a full queue)."""
        if mode not in ("abort", "retract", "in_place"):
            raise EngineRequestError(
                f"Unknown pause mode {mode!r}: use abort, retract or in_place."
            )
        self.paused = True
        if mode == "abort":
            return self.abort(abort_all=True, now=now)
        ended: list[EngineRequest] = []
        if mode == "retract":
            running = self.decoding + self.prefilling
            self.decoding, self.prefilling = [], []
            for left, req in enumerate(running):
                self._retract(req, len(running) - left)
            for req in running:
                victim = self._enqueue(req, now)
                if victim is not None:
                    ended.append(victim)
            self.batch_is_full = False
        return ended

    def resume(self) -> None:
        self.paused = False

    def flush_cache(self) -> bool:
        """Drop every cached page; refused (False) while any request is live."""
        if self.requests:
            return False
        self.kv.flush()
        return True

    # -- state -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.prefilling or self.decoding)

    def running(self) -> list[EngineRequest]:
        return self.prefilling + self.decoding

    def loads(self) -> Loads:
        kv, ps = self.kv, self.page_size
        used = kv.used_pages * ps
        hit = (
            self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        )
        return Loads(
            num_running_reqs=len(self.prefilling) + len(self.decoding),
            num_waiting_reqs=len(self.waiting),
            num_waiting_uncached_tokens=sum(r.total_len for r in self.waiting),
            num_used_tokens=used,
            num_evictable_tokens=kv.evictable_pages * ps,
            num_available_tokens=kv.free_pages * ps,
            max_total_num_tokens=self.total_tokens,
            token_usage=used / self.total_tokens,
            gen_throughput=self.gen_throughput,
            cache_hit_rate=hit,
            new_token_ratio=self.new_token_ratio,
            num_retracted_reqs=self._last_retracted,
            paused=self.paused,
            num_prealloc_reqs=len(self.prealloc),
            num_transfer_reqs=len(self.transferring),
            num_bootstrap_reqs=len(self.bootstrapping),
            num_inflight_reqs=len(self.inflight),
        )

    def check(self) -> None:
        """Assert the pool's invariants against the live requests (tests call this)."""
        computing = self.prefilling + self.decoding + self.inflight
        holders = [(r.node, r.pages) for r in computing + self.transferring]
        for req in self.waiting + self.prealloc + self.bootstrapping:
            if req.node is not None or req.pages or req.computed:
                raise AssertionError(f"waiting request {req.rid} holds KV")
        ps = self.page_size
        for req in self.transferring:
            if len(req.pages) != -(-req.kv_imported // ps) or req.computed:
                raise AssertionError(f"request {req.rid} holds pages that do not fit its prompt")
        for req in computing:
            held = req.tree_len + len(req.pages) * ps
            if held != -(-req.computed // ps) * ps:
                raise AssertionError(
                    f"request {req.rid} computed {req.computed} tokens with {held} tokens of pages"
                )
        self.kv.check(holders)
        if self.host is not None:
            self.host.check()

    # -- one iteration -----------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        result = StepResult()
        if self._ended:
            result.finished.extend(self._ended)
            self._ended.clear()
        if self.paused:
            return result
        if not (self.waiting or self.prefilling or self.decoding):
            self.new_token_ratio = self.init_ratio
            return result
        self.steps += 1
        self._admit(now, result)
        batch = list(self.decoding)  # requests that finish prefill now decode next step
        pf_tokens = pf_pairs = pf_context = 0
        if self.prefilling:
            pf_tokens, pf_pairs, pf_context = self._prefill(now, result)
        dec_seqs = dec_context = 0
        if batch and (pf_tokens == 0 or self.config.enable_mixed_chunk):
            dec_seqs, dec_context = self._decode(batch, now, result)
        if pf_tokens == 0 and dec_seqs == 0 and self.prefilling and not self.decoding:
            # Admitted prefills that cannot get a page while nothing else runs: requeue the
            # newest so the pool cannot deadlock.
            self._requeue(self.prefilling.pop(), now, result)
        result.prefill_tokens = pf_tokens
        result.decode_tokens = dec_seqs
        timing = self.config.timing
        result.duration = timing.iteration_s(pf_tokens, pf_pairs, pf_context, dec_seqs, dec_context)
        host = self.host
        if host is not None:
            # Write-back blocks the eviction that needs it and a load the prefill that
            # reads it: the iteration waits for its copies.
            copied = host.backup_tokens_total + host.load_back_tokens_total
            result.duration += timing.host_transfer_s(copied - self._host_copied)
            self._host_copied = copied
        # What happened in this iteration happened at its end.
        end = now + result.duration
        for req in result.finished:
            req.finished_at = end
        for req in self._firsts:
            req.first_token_at = end
        self._firsts.clear()
        self._tally((now,), (result.duration,), len(result.emitted), pf_tokens > 0, dec_seqs)
        return result

    def _tally(
        self,
        starts: Sequence[float],
        durations: Sequence[float],
        emitted: int,
        prefilled: bool,
        dec_seqs: int,
    ) -> None:
        """Count iterations in the load report's figures: they started at `starts`, took
        `durations`, and each emitted `emitted` tokens, `dec_seqs` of them decoded.
        (The moments are sums of integers, exact in a float at any realistic size, so
        adding a run's at once equals adding them one iteration at a time.)"""
        steps = len(durations)
        self.generation_tokens_total += emitted * steps
        start, count = self._tp_window
        if start is None:
            start = starts[0]
        step_us = [int(duration * 1e6) for duration in durations]
        if prefilled:
            self.prefill_busy_us += sum(step_us)
        counted = 0  # of these iterations, those whose tokens are in `count`
        if dec_seqs:
            total_us = sum(step_us)
            moments = self.decode_moments
            moments[0] += steps
            moments[1] += dec_seqs * steps
            moments[2] += total_us
            moments[3] += dec_seqs * dec_seqs * steps
            moments[4] += dec_seqs * total_us
            moments[5] += dec_seqs * steps
            first = self.decode_steps
            self.decode_steps += steps
            interval = self.config.decode_log_interval
            for i in range(-(first + 1) % interval, steps, interval):
                count += emitted * (i + 1 - counted)
                counted = i + 1
                end = starts[i] + durations[i]
                elapsed = end - start
                self.gen_throughput = count / elapsed if elapsed > 0 else 0.0
                start, count = end, 0
        self._tp_window = (start, count + emitted * (steps - counted))

    # -- decode runs (the fleet simulator's fast-forward) --------------------------------
    def plain_decode(self) -> bool:
        """Whether the next iteration only decodes, and so would every one after it until
        a request finishes or the pool runs out of pages: nothing waits or prefills, and
        no running request can stop on a token (EOS ignored, no stop strings or ids).
        Only the hash backend computes such iterations in a batch (`decode_ahead`)."""
        return (
            not self.paused
            and not self.waiting
            and not self.prefilling
            and bool(self.decoding)
            and not self._ended
            and self.host is None
            and isinstance(self.backend, HashBackend)
            and all(r.ignore_eos and not r.stop and not r.stop_token_ids for r in self.decoding)
        )

    def _page_phases(self) -> dict[int, list[EngineRequest]]:
        """The decoding requests by the iteration, modulo the page size, at which each
        needs its next page (when its KV fills its last one), in batch order; a phase
        no request has is absent."""
        ps = self.page_size
        phases: dict[int, list[EngineRequest]] = {}
        for req in self.decoding:
            phase = (req.tree_len + len(req.pages) * ps - req.computed) % ps
            members = phases.get(phase)
            if members is None:
                phases[phase] = [req]
            else:
                members.append(req)
        return phases

    def decode_run(self, now: float, limit: int, until: float) -> tuple[list[float], list[int]]:
        """The durations of the iterations from `now` on, run back to back, that each
        decode every running request and nothing else — none finishing a request or short
        of pages (`plain_decode` must hold): at most `limit`, the last being the first to
        end at or after `until`; and the pages in use after each (what `decode_ahead`
        returns for them). Nothing changes here; `decode_ahead` runs them."""
        batch, ps = self.decoding, self.page_size
        limit = min(limit, min(r.max_new_tokens - len(r.output_ids) for r in batch) - 1)
        needs = [0] * ps
        for phase, members in self._page_phases().items():
            needs[phase] = len(members)
        available = self.kv.available_pages
        steps = 0
        while steps < limit:
            need = needs[steps % ps]
            if need > available:
                break  # this one retracts
            available -= need
            steps += 1
        context = sum(r.computed for r in batch) + len(batch)
        durations = self.config.timing.decode_run_s(len(batch), context, steps, now, until)
        in_use = self.kv.used_pages
        used = []
        for step in range(len(durations)):
            in_use += needs[step % ps]
            used.append(in_use)
        return durations, used

    def decode_ahead(self, starts: Sequence[float], durations: Sequence[float]) -> list[int]:
        """Run the next iterations `decode_run` planned (their starts and durations) as
        `step` would one by one: each running request gets a token per iteration, and
        pages go to them in the same order. Returns the pages in use after each."""
        backend = self.backend
        assert isinstance(backend, HashBackend)
        batch, kv, ps = self.decoding, self.kv, self.page_size
        count = len(starts)
        phases = self._page_phases()
        in_use = kv.used_pages
        used: list[int] = []
        for step in range(count):
            phase = phases.get(step % ps)
            if phase:
                pages = kv.allocate(len(phase))
                assert pages is not None, "decode_run planned pages that are not there"
                for req, page in zip(phase, pages, strict=True):
                    req.pages.append(page)
                in_use += len(pages)
            used.append(in_use)
        for req in batch:
            tokens, req.hash_state = backend.decode_run(req, count)
            req.output_ids.extend(tokens)
            req.computed += count
        self.steps += count
        if self.config.priority_preemption:
            self.batch_is_full = False  # what `_admit` does with nothing waiting
        for _ in range(count):
            if self.new_token_ratio == self.min_ratio:
                break  # it stays there
            self._decay_ratio()
        self._tally(starts, durations, len(batch), False, len(batch))
        return used

    # -- admission -----------------------------------------------------------------------
    def _order_waiting(self, now: float) -> None:
        cfg = self.config
        if cfg.schedule_policy == "lpm" and self.kv.prefix_cache:
            if len(self.waiting) <= LPM_MAX_WAITING:  # beyond, matching costs too much
                self._sort_longest_prefix()
        elif cfg.enable_priority_scheduling:
            sign = 1 if cfg.schedule_low_priority_values_first else -1
            aging = cfg.priority_aging_s
            if aging:
                self.waiting.sort(
                    key=lambda r: (sign * r.priority - (now - r.queued_at) / aging, r.queued_at)
                )
            else:
                self.waiting.sort(key=lambda r: (sign * r.priority, r.queued_at))

    def _sort_longest_prefix(self) -> None:
        """LPM: the longest cached prefix first; a request with little cached that shares
        its first tokens with an earlier waiting one goes last, so that one fills the
        cache for it (SGLang's in-batch prefix caching)."""
        heads: set[tuple[str, tuple[int, ...]]] = set()
        keys: dict[int, float] = {}
        for req in self.waiting:
            history = req.history()
            matched = self.kv.match(history, req.total_len - 1, req.cache_salt)[1]
            keys[id(req)] = -matched
            if matched <= IN_BATCH_PREFIX_TOKENS and len(history) >= IN_BATCH_PREFIX_TOKENS:
                head = (req.cache_salt, tuple(history[:IN_BATCH_PREFIX_TOKENS]))
                if head in heads:
                    keys[id(req)] = math.inf
                else:
                    heads.add(head)
        self.waiting.sort(key=lambda r: keys[id(r)])

    def _running_offset(self, req: EngineRequest) -> float:
        """What a decoding request may still grow into, as admission estimates it."""
        ratio = 1.0 if req.ignore_eos and self.v0523 else self.new_token_ratio
        return min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS) * ratio

    def _admit(self, now: float, result: StepResult) -> None:
        """One pass of SGLang's PrefillAdder (see the module docstring)."""
        cfg = self.config
        preemption = cfg.priority_preemption
        if preemption or not self.decoding:
            self.batch_is_full = False
        continuing = self.prefilling
        if (self.batch_is_full or not self.waiting) and not continuing:
            return
        limit = cfg.running_limit
        if not continuing and len(self.decoding) >= limit and not preemption:
            self.batch_is_full = True
            return
        if self.waiting:
            self._order_waiting(now)
        kv, ps = self.kv, self.page_size
        yielding = cfg.prefill_yield
        mixed = len(self.decoding) if cfg.enable_mixed_chunk else 0
        chunk = cfg.chunked_prefill_size
        budget = _PrefillBudget(
            kv,
            ps,
            page_charge=ps if self.v0523 else 0,
            total_offset=mixed + sum((self._running_offset(r) for r in self.decoding), 0.0),
            current_offset=mixed,
            rem_input=cfg.max_prefill_tokens - mixed,
            rem_chunk=chunk - mixed if chunk > 0 else None,
        )
        for req in continuing:
            self._plan_continuation(req, budget, yielding)
        admitted = len(continuing)
        preempted: list[EngineRequest] = []
        taken: set[int] = set()
        for req in self.waiting:
            if budget.state() == _OTHER:
                break
            if admitted >= limit - len(self.decoding):
                self.batch_is_full = True
            if self.batch_is_full and not (
                preemption and self._preempt_for(req, budget, preempted, result)
            ):
                break
            verdict = self._add_one(req, budget, admitted, yielding, now)
            if req.phase is Phase.PREFILL:
                taken.add(id(req))
                admitted += 1
                result.admitted.append(req)
            if verdict != _CONTINUE:
                if verdict == _NO_TOKEN:
                    self.batch_is_full = admitted > 0 or bool(self.decoding)
                break
        if taken:
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        for req in preempted:
            victim = self._enqueue(req, now)
            if victim is not None:
                result.finished.append(victim)

    def _plan_continuation(
        self, req: EngineRequest, budget: _PrefillBudget, yielding: bool
    ) -> None:
        """A request already prefilling takes its next chunk first (SGLang's
        add_chunked_req): as much of the chunk budget and the pool as it can use, never
        nothing. With `prefill_yield` it shares the iteration's budget in `_prefill`
        instead, so only its KV is reserved here. (Transferred KV costs pages, not
        compute: the budgets count only what is computed.)"""
        start = max(req.computed, req.placed_end)
        remaining = req.total_len - start
        max_new = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        if yielding:
            req.prefill_end = req.total_len
            budget.reserve(req.total_len - req.computed, 0, max_new)
            return
        room = remaining
        if budget.rem_chunk is not None:
            room = min(budget.rem_chunk, int(budget.remaining_total))
            if room <= 0:
                room = budget.rem_chunk
        take = min(remaining, room)
        req.prefill_end = start + take
        last = take == remaining
        budget.reserve(req.prefill_end - req.computed, take, max_new if last else 0)

    def _add_one(
        self,
        req: EngineRequest,
        budget: _PrefillBudget,
        admitted: int,
        yielding: bool,
        now: float,
    ) -> str:
        """Admit a waiting request if the budget holds it (SGLang's add_one_req); the
        verdict says whether the pass goes on."""
        kv, ps = self.kv, self.page_size
        history = req.history()
        node, matched = kv.match(history, req.total_len - 1, req.cache_salt)
        onboard = 0
        if self.host is not None and not req.kv_imported:  # P/D imports load no host pages
            onboard = self.host.match(req.cache_salt, history, matched, req.total_len - 1)
        extend = req.total_len - matched
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        # Its cached prefix is locked while it is weighed: that part is not evictable.
        held = kv.evictable_on_path(node) * ps
        if extend + max_new + budget.page_charge >= budget.remaining_total - held:
            return _NO_TOKEN
        start = max(matched + onboard, req.kv_imported)  # placed KV is not computed
        paged = budget.paged(req.total_len - start)
        if admitted and paged >= budget.rem_input and (budget.rem_chunk is None or not self.v0523):
            return _OTHER
        end, reserved_new = req.total_len, min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        if budget.rem_chunk is not None and paged > budget.rem_chunk and not yielding:
            # The chunk budget's last request: cut at a page boundary, chunked from now on.
            end, reserved_new = (start + budget.rem_chunk) // ps * ps, 0
            if end <= start:
                return _OTHER
        kv.lock(node)
        req.node, req.tree_len = node, matched
        req.computed = matched
        req.onboard_end = matched + onboard if onboard else 0
        req.prefill_end = end
        req.cached_tokens += matched + onboard
        req.host_cached_tokens += onboard
        self.cached_tokens_total += matched + onboard if not req.output_ids else 0
        req.phase = Phase.PREFILL
        req.prefill_yields = 0
        if req.admitted_at < 0:
            req.admitted_at = now
        self.prefilling.append(req)
        budget.reserve(end - matched, end - start, reserved_new)
        return budget.state()

    def _preempt_for(
        self,
        req: EngineRequest,
        budget: _PrefillBudget,
        preempted: list[EngineRequest],
        result: StepResult,
    ) -> bool:
        """At the running limit, retract running requests whose priority is more than the
        threshold below the newcomer's — least preferred and newest first — until their
        reservations would cover it (SGLang's preempt_to_schedule). They rejoin the queue
        after the pass."""
        cfg = self.config
        sign = 1 if cfg.schedule_low_priority_values_first else -1
        matched = self.kv.match(req.history(), req.total_len - 1, req.cache_salt)[1]
        needed = (
            req.total_len
            - matched
            + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            - budget.remaining_total
        )
        chosen: list[EngineRequest] = []
        for running in sorted(self.decoding, key=lambda r: (-sign * r.priority, -r.queued_at)):
            if (
                -sign * (req.priority - running.priority)
                <= cfg.priority_scheduling_preemption_threshold
            ):
                break
            chosen.append(running)
            needed -= self._running_offset(running)
            if needed <= 0:
                break
        if not chosen or needed > 0:
            return False
        gone = {id(r) for r in chosen}
        self.decoding = [r for r in self.decoding if id(r) not in gone]
        for kept, running in enumerate(chosen, 1):
            budget.total_offset -= self._running_offset(running)
            self._retract(running, len(self.decoding) + len(chosen) - kept)
        preempted.extend(chosen)
        result.retracted.extend(chosen)
        self.retracted_total += len(chosen)
        return True

    # -- prefill -------------------------------------------------------------------------
    def _prefill(self, now: float, result: StepResult) -> tuple[int, int, int]:
        """Compute the chunks admission planned; with `prefill_yield`, share the
        iteration's token budget out instead, shortest remainder first (with aging)."""
        cfg = self.config
        yielding = cfg.prefill_yield
        if yielding:
            limit = cfg.prefill_max_yields
            order = sorted(
                self.prefilling,
                key=lambda r: (r.prefill_yields < limit, r.total_len - r.computed),
            )
        else:
            order = list(self.prefilling)
        budget = self.prefill_budget
        kv, ps = self.kv, self.page_size
        tokens = pairs = context = 0
        served: set[int] = set()
        for req in order:
            if yielding and budget <= 0:
                break
            if req.placed_end > req.computed:
                self._import(req)
                if req.computed < req.placed_end:
                    continue  # not all of the placed KV has a page yet
            start = req.computed
            if yielding:
                end = min(req.total_len, start + int(min(budget, req.total_len - start)))
            else:
                end = req.prefill_end
                if end <= start:
                    continue
            if self.time_budget is not None:
                end = self._fit_time(start, end, tokens, pairs, context)
                if end <= start:
                    break
            held = req.tree_len // ps + len(req.pages)
            need = -(-end // ps) - held
            if need > 0:
                spare = kv.available_pages
                if need > spare:
                    # KV budget: compute what the pages we can get will hold.
                    end = min(end, (held + spare) * ps)
                    need = -(-end // ps) - held
                    if end <= start:
                        continue
                pages = kv.allocate(need)
                assert pages is not None
                req.pages.extend(pages)
            token = self.backend.prefill(req, start, end)
            req.computed = end
            n = end - start
            tokens += n
            pairs += (end * (end + 1) - start * (start + 1)) // 2
            context += start
            budget -= n
            served.add(id(req))
            self._cache_full_pages(req)
            if token is not None:
                self._prefilled(req, token, now, result)
        if tokens and yielding:
            for req in self.prefilling:
                if id(req) not in served:
                    req.prefill_yields += 1
                elif req.computed < req.total_len:
                    req.prefill_yields = 0
        return tokens, pairs, context

    def _import(self, req: EngineRequest) -> None:
        """Place transferred or host-held KV: pages for those tokens, no compute, as
        many as the free pages hold. Host pages are counted only once the pages to load
        them into exist (allocating may write back, and so evict, host pages); pages
        allocated for host pages no longer there are given back, and the request
        computes those tokens instead."""
        kv, ps = self.kv, self.page_size
        held = req.tree_len // ps + len(req.pages)
        end = min(req.placed_end, (held + kv.available_pages) * ps)
        if end <= req.computed:
            return
        need = -(-end // ps) - held
        if need > 0:
            pages = kv.allocate(need)
            assert pages is not None
            req.pages.extend(pages)
        imported = max(req.computed, min(end, req.kv_imported))
        self.imported_tokens_total += imported - req.computed
        if end > imported:
            assert self.host is not None
            wanted = end
            end = imported + self.host.match(req.cache_salt, req.history(), imported, end)
            self.host.loaded(end - imported)
            if end < wanted:
                req.onboard_end = end
                surplus = len(req.pages) - (-(-end // ps) - req.tree_len // ps)
                if surplus > 0:
                    kv.free(req.pages[-surplus:])
                    del req.pages[-surplus:]
        req.computed = end
        self._cache_full_pages(req)

    def _fit_time(self, start: int, end: int, tokens: int, pairs: int, context: int) -> int:
        """The largest chunk end ≤ `end` whose iteration, with the chunks already chosen,
        stays within the prefill time budget (the first chunk always gets a page's worth,
        so prefill progresses whatever the budget)."""
        assert self.time_budget is not None
        timing, budget = self.config.timing, self.time_budget

        def fits(stop: int) -> bool:
            extra = (stop * (stop + 1) - start * (start + 1)) // 2
            took = timing.iteration_s(tokens + stop - start, pairs + extra, context + start, 0, 0)
            return took <= budget

        if fits(end):
            return end
        # The roofline's closed form is right but for rounding: its guess is the answer
        # when the chunk it ends fits and one token more does not (iteration time only
        # grows with the chunk), else the search below finds it.
        guess = timing.prefill_stop(start, tokens, pairs, context, budget)
        lo = min(end - 1, max(start, math.floor(guess))) if math.isfinite(guess) else start
        hi = end
        if (lo == start or fits(lo)) and (lo + 1 == end or not fits(lo + 1)):
            hi = lo + 1
        else:
            lo = start  # fits(lo) or lo == start; not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        if lo == start and tokens == 0:
            return min(end, start + self.page_size)
        return lo

    def _prefilled(self, req: EngineRequest, token: int, now: float, result: StepResult) -> None:
        """The request's whole history has KV: take its sampled token and start decoding."""
        if len(req.output_ids) >= req.max_new_tokens:  # max_new_tokens == 0
            self._finish(req, Finish("length", length=req.max_new_tokens), now)
            result.finished.append(req)
            return
        if req.first_token_at < 0:
            self._firsts.append(req)
        self.prefilling.remove(req)
        if req.kv_export:
            # The handoff token goes with the KV; stop conditions are the decode side's.
            req.output_ids.append(token)
            req.hash_state = _crc32(TOKEN_BYTES[token], req.hash_state)
            req.phase = Phase.INFLIGHT
            self.inflight.append(req)
            result.emitted.append(req)
            result.exported.append(req)
            return
        req.phase = Phase.DECODE
        self.decoding.append(req)
        self._append(req, token, now, result)

    def _cache_full_pages(self, req: EngineRequest) -> None:
        end = req.computed // self.page_size * self.page_size
        if end > req.tree_len and self.kv.prefix_cache:
            last = req.node if req.node is not None else self.kv.root(req.cache_salt)
            req.node = self.kv.adopt(last, req.pages, req.history(), req.tree_len, end)
            req.tree_len = end

    # -- decode --------------------------------------------------------------------------
    def _decode(
        self, batch: list[EngineRequest], now: float, result: StepResult
    ) -> tuple[int, int]:
        kv, ps = self.kv, self.page_size
        needing = [r for r in batch if r.computed == r.tree_len + len(r.pages) * ps]
        if len(needing) > kv.available_pages:
            self._retract_for(now, result)
            fresh = {id(r) for r in batch}
            batch = [r for r in self.decoding if id(r) in fresh]
            needing = [r for r in batch if r.computed == r.tree_len + len(r.pages) * ps]
            if not batch:
                return 0, 0
        else:
            self._decay_ratio()
        if needing:
            pages = kv.allocate(len(needing))
            assert pages is not None
            for req, page in zip(needing, pages, strict=True):
                req.pages.append(page)
        tokens = self.backend.decode(batch)
        context = 0
        emitted = result.emitted
        for req, token in zip(batch, tokens, strict=True):
            context += req.computed
            req.computed += 1
            out = req.output_ids
            out.append(token)
            req.hash_state = _crc32(TOKEN_BYTES[token], req.hash_state)
            emitted.append(req)
            if (
                token == EOS_ID or len(out) >= req.max_new_tokens or req.stop or req.stop_token_ids
            ) and self._check_finish(req, token, now):
                result.finished.append(req)
        return len(batch), context + len(batch)

    def _decay_ratio(self) -> None:
        """A decode iteration that kept every request lowers the new-token ratio a step."""
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)

    def _append(self, req: EngineRequest, token: int, now: float, result: StepResult) -> None:
        """Add one sampled token outside the decode loop (first token after prefill)."""
        req.output_ids.append(token)
        req.hash_state = _crc32(TOKEN_BYTES[token], req.hash_state)
        result.emitted.append(req)
        if self._check_finish(req, token, now):
            result.finished.append(req)

    def _check_finish(self, req: EngineRequest, token: int, now: float) -> bool:
        n = len(req.output_ids)
        finish: Finish | None = None
        if token == EOS_ID:
            finish = Finish("stop", matched=EOS_ID)
        elif token in req.stop_token_ids and not req.eos_suppressed:
            # As EOS: never with ignore_eos, and SGLang's sampler keeps stop tokens out
            # until min_new_tokens.
            finish = Finish("stop", matched=token)
        elif req.stop:
            # Only the newest bytes can complete a stop string not seen before.
            tail = decode(req.output_ids[-(req.stop_window + 1) :])
            for stop in req.stop:
                if stop in tail:
                    req.stop_at = decode(req.output_ids).find(stop)
                    finish = Finish("stop", matched=stop)
                    break
        if finish is None and n >= req.max_new_tokens:
            finish = Finish("length", length=n)
        if finish is None:
            return False
        self._finish(req, finish, now)
        return True

    # -- retraction ----------------------------------------------------------------------
    def _retract_for(self, now: float, result: StepResult) -> None:
        """Decode is out of pages: retract decoding requests, the least preferred first,
        until the rest can each get the page they need — at least one, never the last
        (SGLang's retract_decode). A last request that still cannot grow is aborted."""
        kv, ps = self.kv, self.page_size
        kept = self._retraction_order()
        victims: list[EngineRequest] = []
        while len(kept) > 1:
            victim = kept.pop()
            self._retract(victim, len(kept))
            victims.append(victim)
            needing = sum(r.computed == r.tree_len + len(r.pages) * ps for r in kept)
            if needing <= kv.available_pages:
                break
        self.decoding = [r for r in self.decoding if r.phase is Phase.DECODE]
        if len(kept) == 1 and not kv.available_pages:
            last = kept[0]
            if last.computed == last.tree_len + len(last.pages) * ps:
                message = (
                    "Out of memory even after retracting all other requests in the decode "
                    "batch. Aborting the last request."
                )
                self._finish(last, aborted(message, 500), now)
                result.finished.append(last)
                self.aborted_total += 1
        # The estimate SGLang takes from the requests kept: what they decoded so far, plus
        # the retraction's headroom each, over what they may decode.
        decoded = sum(len(r.output_ids) for r in self.decoding)
        allowed = sum(r.max_new_tokens for r in self.decoding)
        self.new_token_ratio = min(
            1.0, (decoded + RETRACT_DECODE_STEPS * len(self.decoding)) / (allowed + 1)
        )
        self.retracted_total += len(victims)
        self._last_retracted = len(victims)
        result.retracted.extend(victims)
        for req in victims:
            dropped = self._enqueue(req, now)
            if dropped is not None:
                result.finished.append(dropped)

    def _retraction_order(self) -> list[EngineRequest]:
        """Decoding requests, the one to keep most first: most output tokens, then the
        shortest prompt (with retraction_policy priority, the most preferred priority
        before that)."""
        cfg = self.config
        if cfg.retraction_policy == "priority":
            sign = 1 if cfg.schedule_low_priority_values_first else -1
            return sorted(
                self.decoding,
                key=lambda r: (-sign * r.priority, len(r.output_ids), -len(r.input_ids)),
                reverse=True,
            )
        return sorted(
            self.decoding, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True
        )

    def _retract(self, req: EngineRequest, kept: int) -> None:
        """Free a request's KV for a full recompute. What it decoded does not enter the
        prefix cache (SGLang frees it at once), and the cache gives up what the `kept`
        requests need for their next RETRACT_DECODE_STEPS steps."""
        self._release(req, cache=False)
        need = -(-kept * RETRACT_DECODE_STEPS // self.page_size) - self.kv.free_pages
        if need > 0:
            self.kv.evict(need)
        req.computed = 0
        req.kv_imported = 0  # the transferred KV is gone: a recompute computes it all
        req.onboard_end = 0
        req.retractions += 1
        req.phase = Phase.WAITING
        self.batch_is_full = False

    def _requeue(self, req: EngineRequest, now: float, result: StepResult) -> None:
        self._retract(req, len(self.decoding))
        result.retracted.append(req)
        victim = self._enqueue(req, now)
        if victim is not None:
            result.finished.append(victim)

    # -- release -------------------------------------------------------------------------
    def _release(self, req: EngineRequest, cache: bool) -> None:
        """Give back the request's KV. With `cache`, its computed full pages stay cached
        (evictable), so a continuation of the same history hits the prefix cache."""
        kv = self.kv
        if req.node is not None or req.pages:
            if cache:
                self._cache_full_pages(req)
            if req.node is not None:
                kv.unlock(req.node)
            kv.free(req.pages)
            req.node, req.tree_len = None, 0
            req.pages = []

    def _finish(self, req: EngineRequest, finish: Finish, now: float) -> None:
        if req.finish is not None:
            return
        phase = req.phase
        req.finished_at = now
        holds_no_kv = (Phase.WAITING, Phase.PREALLOC, Phase.TRANSFER, Phase.BOOTSTRAP)
        self._release(req, cache=phase not in holds_no_kv)
        req.finish = finish
        req.phase = Phase.FINISHED
        self.requests.pop(req.rid, None)
        if phase is Phase.WAITING:
            self.waiting.remove(req)
        elif phase is Phase.PREALLOC:
            self.prealloc.remove(req)
        elif phase is Phase.TRANSFER:
            self.transferring.remove(req)
        elif phase is Phase.BOOTSTRAP:
            self.bootstrapping.remove(req)
        elif phase is Phase.INFLIGHT:
            self.inflight.remove(req)
        elif phase is Phase.PREFILL:
            self.prefilling.remove(req)
            self.batch_is_full = False
        elif phase is Phase.DECODE:
            self.decoding.remove(req)
            self.batch_is_full = False
