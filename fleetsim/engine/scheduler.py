"""The engine model: SGLang's scheduler, stepping one iteration at a time on a caller's clock.

Nothing here reads a clock or does I/O: `now` comes in, an iteration's duration (from the
roofline timing model) goes out. The HTTP server sleeps that duration (over its speed
factor) in real time; the fleet simulator adds it to virtual time.

One iteration:
1. admission (SGLang's PrefillAdder): waiting requests, in policy order, are admitted while
   `available + evictable − Σ running min(max_new − generated, 4096) × new_token_ratio`
   still covers their uncached history plus clipped max-new-tokens, the running limit
   allows, and this iteration's prefill budget is not yet covered. The first one that does
   not fit stops admission (SGLang's head-of-line behaviour).
2. prefill: admitted requests compute their history in chunks, within a token budget
   (`chunked_prefill_size`), an optional time budget and the KV that can be allocated. A
   request that reaches the end of its history samples its first token and joins decode.
3. decode (in the same iteration with `enable_mixed_chunk`, else only when there was no
   prefill): every decoding request writes the KV of its last token and samples one more.
   When the pages for that do not exist, the requests with the fewest output tokens are
   retracted (KV freed, requeued for full recompute) until they do.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetsim.engine.backends import HashBackend, TokenBackend
from fleetsim.engine.config import CLIP_MAX_NEW_TOKENS, EngineConfig
from fleetsim.engine.kv_cache import KVCache
from fleetsim.engine.request import EngineRequest, Finish, Phase, aborted
from fleetsim.engine.tokens import (
    EOS_ID,
    TOKEN_BYTES,
    VOCAB_SIZE,
    TokenFunction,
    decode,
    prefix_hash,
)

_crc32 = zlib.crc32


class RequestError(ValueError):
    """A request the engine refuses outright (SGLang answers these with 400)."""


@dataclass(slots=True)
class StepResult:
    """What one iteration did. `emitted` got exactly one new token each (its last
    `output_ids` entry); `finished` ended this step (also listed in `emitted` when their
    final token came this step); `retracted` lost their KV and wait for recompute."""

    duration: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    emitted: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    retracted: list[EngineRequest] = field(default_factory=list)

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


class EngineModel:
    """SGLang's scheduler over a KV pool. See the module docstring for one iteration."""

    def __init__(self, config: EngineConfig, backend: TokenBackend | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.total_tokens = config.total_tokens
        self.context_len = config.context_len
        self.kv = KVCache(
            self.total_tokens // self.page_size,
            self.page_size,
            prefix_cache=not config.disable_radix_cache,
        )
        self.backend: TokenBackend = backend or HashBackend(TokenFunction(config.eos_per_mille))
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []
        self.prefilling: list[EngineRequest] = []
        self.decoding: list[EngineRequest] = []
        self.paused = False
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
        self._firsts: list[EngineRequest] = []

    # -- requests in -----------------------------------------------------------------
    def make_request(
        self,
        rid: str,
        input_ids: list[int],
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
        """A validated request. Raises RequestError with SGLang's message on bad input;
        `max_new_tokens=None` means "up to the context length".

        `kv_imported` (P/D decode side): the KV of the first `kv_imported` tokens was
        computed by a prefill engine and arrives by transfer, so admission still needs
        pages for them but no iteration computes them. At least the last token of the
        history is computed here, to sample the next one. (With the hash backend, tokens
        depend only on the history, so an imported request continues exactly as the
        uninterrupted one; a backend holding real KV content has nothing to import.)"""
        if not input_ids:
            raise RequestError("The input must not be empty.")
        low, high = min(input_ids), max(input_ids)
        if low < 0 or high >= VOCAB_SIZE:
            bad = low if low < 0 else high
            raise RequestError(f"Token id {bad} is out of the vocabulary (0..{VOCAB_SIZE - 1}).")
        n = len(input_ids)
        if n >= self.context_len:
            raise RequestError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if n > self.config.max_req_input_len:
            raise RequestError(
                f"The input ({n} tokens) is longer than the maximum request input length "
                f"({self.config.max_req_input_len} tokens)."
            )
        if max_new_tokens is None:
            max_new_tokens = self.context_len - n
        if max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if n + max_new_tokens > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {n + max_new_tokens} "
                f"tokens: {n} tokens from the input messages and {max_new_tokens} tokens "
                f"for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit."
            )
        if not 0 <= kv_imported < n:
            raise RequestError(f"kv_imported must be in [0, {n}), got {kv_imported}.")
        if min_new_tokens < 0 or min_new_tokens > max_new_tokens:
            raise RequestError(
                f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], "
                f"got {min_new_tokens}."
            )
        return EngineRequest(
            rid=rid,
            input_ids=list(input_ids),
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            min_new_tokens=min_new_tokens,
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(stop_token_ids),
            priority=priority,
            cache_salt=cache_salt,
            arrival=now,
            kv_imported=kv_imported,
        )

    def submit(self, req: EngineRequest, now: float) -> bool:
        """Queue a request. False when the queue is full: the request then is finished
        with SGLang's 503 abort and never touches the pool."""
        if req.rid in self.requests:
            raise RequestError(f"Duplicate request ID {req.rid!r}.")
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            req.finish = aborted("The request queue is full.", 503)
            req.phase = Phase.FINISHED
            req.finished_at = now
            self.aborted_total += 1
            return False
        req.arrival = now
        req.hash_state = prefix_hash(req.output_ids, prefix_hash(req.input_ids))
        self.requests[req.rid] = req
        self.waiting.append(req)
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        return True

    # -- control -----------------------------------------------------------------------
    def abort(
        self,
        rid: str = "",
        *,
        abort_all: bool = False,
        now: float = 0.0,
        message: str = "Abort request by the client.",
    ) -> list[EngineRequest]:
        """SGLang's abort: every live request whose rid starts with `rid` (or all).
        An empty rid without `abort_all` aborts nothing; unknown rids are ignored."""
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
        self, req: EngineRequest, now: float, message: str = "Abort request by the client."
    ) -> list[EngineRequest]:
        """Abort exactly this request (a client that went away); [] if already over."""
        if req.finish is not None or self.requests.get(req.rid) is not req:
            return []
        self._finish(req, aborted(message), now)
        self.aborted_total += 1
        return [req]

    def pause(self, mode: str, now: float) -> list[EngineRequest]:
        """SGLang's /pause_generation: `abort` ends every request, `retract` frees every
        running request's KV and requeues it, `in_place` just stops stepping. New requests
        queue until `resume`. Returns the requests aborted."""
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"Unknown pause mode {mode!r}: use abort, retract or in_place.")
        self.paused = True
        if mode == "abort":
            return self.abort(abort_all=True, now=now, message="Abort by pause_generation.")
        if mode == "retract":
            for req in self.decoding + self.prefilling:
                self._retract(req)
            self.waiting[:0] = self.prefilling + self.decoding
            self.decoding.clear()
            self.prefilling.clear()
        return []

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
        )

    def check(self) -> None:
        """Assert the pool's invariants against the live requests (tests call this)."""
        holders = [(r.node, r.pages) for r in self.prefilling + self.decoding]
        for req in self.waiting:
            if req.node is not None or req.pages or req.computed:
                raise AssertionError(f"waiting request {req.rid} holds KV")
        ps = self.page_size
        for req in self.prefilling + self.decoding:
            held = req.tree_len + len(req.pages) * ps
            if held != -(-req.computed // ps) * ps:
                raise AssertionError(
                    f"request {req.rid} computed {req.computed} tokens with {held} tokens of pages"
                )
        self.kv.check(holders)

    # -- one iteration -----------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        result = StepResult()
        if self.paused:
            return result
        if not (self.waiting or self.prefilling or self.decoding):
            self.new_token_ratio = self.init_ratio
            return result
        self.steps += 1
        if self.waiting:
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
            self._requeue(self.prefilling.pop(), result)
        result.prefill_tokens = pf_tokens
        result.decode_tokens = dec_seqs
        result.duration = self.config.timing.iteration_s(
            pf_tokens, pf_pairs, pf_context, dec_seqs, dec_context
        )
        # What happened in this iteration happened at its end.
        end = now + result.duration
        for req in result.finished:
            req.finished_at = end
        for req in self._firsts:
            req.first_token_at = end
        self._firsts.clear()
        if dec_seqs and not result.retracted:
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        emitted = len(result.emitted)
        self.generation_tokens_total += emitted
        start, count = self._tp_window
        if start is None:
            start = now
        count += emitted
        if dec_seqs:
            self.decode_steps += 1
            if self.decode_steps % self.config.decode_log_interval == 0:
                elapsed = now + result.duration - start
                self.gen_throughput = count / elapsed if elapsed > 0 else 0.0
                start, count = now + result.duration, 0
        self._tp_window = (start, count)
        return result

    # -- admission -----------------------------------------------------------------------
    def _order_waiting(self, now: float) -> None:
        cfg = self.config
        if cfg.schedule_policy == "lpm" and self.kv.prefix_cache:
            self.waiting.sort(
                key=lambda r: -self.kv.match(r.history(), r.total_len - 1, r.cache_salt)[1]
            )
        elif cfg.enable_priority_scheduling:
            sign = 1 if cfg.schedule_low_priority_values_first else -1
            aging = cfg.priority_aging_s
            if aging:
                self.waiting.sort(
                    key=lambda r: (sign * r.priority - (now - r.arrival) / aging, r.arrival)
                )
            else:
                self.waiting.sort(key=lambda r: (sign * r.priority, r.arrival))

    def _reserved_growth(self) -> float:
        """Σ over running requests of their clipped remaining output × new_token_ratio,
        plus the history admitted prefills still have to compute."""
        growth = 0
        for r in self.decoding:
            growth += min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
        pending = 0
        for r in self.prefilling:
            growth += min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
            pending += r.total_len - r.computed
        return growth * self.new_token_ratio + pending

    def _admit(self, now: float, result: StepResult) -> None:
        self._order_waiting(now)
        kv, ps = self.kv, self.page_size
        reserved = self._reserved_growth()
        running = len(self.prefilling) + len(self.decoding)
        limit = self.config.running_limit
        # Admit about one iteration's prefill work. With yielding, work already admitted
        # does not count: new short prompts must be able to overtake a long one.
        pending = 0
        if not self.config.prefill_yield:
            pending = sum(r.total_len - r.computed for r in self.prefilling)
        admitted = 0
        for req in self.waiting:
            if running >= limit or pending >= self.prefill_budget:
                break
            history = req.history()
            node, matched = kv.match(history, req.total_len - 1, req.cache_salt)
            uncached = req.total_len - matched
            clipped = min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
            evictable_hit = kv.evictable_on_path(node) * ps
            available = kv.available_pages * ps - evictable_hit
            if uncached + clipped > available - reserved and (running or uncached > available):
                # With nothing running the head is admitted if its history fits at all, or
                # it would block the queue forever. A history that cannot fit even then
                # (retracted after its last token filled the pool) never will: fail closed.
                if not running:
                    self._finish(req, aborted("The KV cache cannot hold this request.", 503), now)
                    self.aborted_total += 1
                    result.finished.append(req)
                break
            kv.lock(node)
            req.node, req.tree_len = node, matched
            req.computed = matched
            req.cached_tokens += matched
            self.cached_tokens_total += matched if not req.output_ids else 0
            req.phase = Phase.PREFILL
            req.prefill_yields = 0
            if req.admitted_at < 0:
                req.admitted_at = now
            self.prefilling.append(req)
            reserved += uncached + clipped * self.new_token_ratio
            pending += uncached
            running += 1
            admitted += 1
        if admitted:
            del self.waiting[:admitted]

    # -- prefill -------------------------------------------------------------------------
    def _prefill(self, now: float, result: StepResult) -> tuple[int, int, int]:
        cfg = self.config
        if cfg.prefill_yield:
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
            if budget <= 0:
                break
            if req.kv_imported > req.computed:
                self._import(req)
                if req.computed < req.kv_imported:
                    continue  # not all of the transferred KV has a page yet
            start = req.computed
            end = min(req.total_len, start + int(min(budget, req.total_len - start)))
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
        if tokens and cfg.prefill_yield:
            for req in self.prefilling:
                if id(req) not in served:
                    req.prefill_yields += 1
                elif req.computed < req.total_len:
                    req.prefill_yields = 0
        return tokens, pairs, context

    def _import(self, req: EngineRequest) -> None:
        """Place transferred KV: pages for the imported tokens, no compute, as many as
        the free pages hold."""
        kv, ps = self.kv, self.page_size
        held = req.tree_len // ps + len(req.pages)
        end = min(req.kv_imported, (held + kv.available_pages) * ps)
        if end <= req.computed:
            return
        need = -(-end // ps) - held
        if need > 0:
            pages = kv.allocate(need)
            assert pages is not None
            req.pages.extend(pages)
        self.imported_tokens_total += end - req.computed
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
        lo, hi = start, end  # fits(lo) or lo == start; not fits(hi)
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
            self._retract_for(len(needing), now, result)
            fresh = {id(r) for r in batch}
            batch = [r for r in self.decoding if id(r) in fresh]
            needing = [r for r in batch if r.computed == r.tree_len + len(r.pages) * ps]
            if not batch:
                return 0, 0
        if needing:
            pages = kv.allocate(len(needing))
            assert pages is not None
            for req, page in zip(needing, pages, strict=True):
                req.pages.append(page)
        tokens = self.backend.decode(batch)
        context = 0
        emitted = result.emitted
        ctx_len = self.context_len
        for req, token in zip(batch, tokens, strict=True):
            context += req.computed
            req.computed += 1
            out = req.output_ids
            out.append(token)
            req.hash_state = _crc32(TOKEN_BYTES[token], req.hash_state)
            emitted.append(req)
            n = len(out)
            if (
                token == EOS_ID
                or n >= req.max_new_tokens
                or n + len(req.input_ids) >= ctx_len
                or req.stop
                or token in req.stop_token_ids
            ) and self._check_finish(req, token, now):
                result.finished.append(req)
        return len(batch), context + len(batch)

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
        elif token in req.stop_token_ids:
            finish = Finish("stop", matched=token)
        elif req.stop:
            # Only the newest bytes can complete a stop string not seen before.
            tail = decode(req.output_ids[-(req.stop_window + 1) :])
            for stop in req.stop:
                if stop in tail:
                    req.stop_at = decode(req.output_ids).find(stop)
                    finish = Finish("stop", matched=stop)
                    break
        if finish is None and (
            n >= req.max_new_tokens or n + len(req.input_ids) >= self.context_len
        ):
            finish = Finish("length", length=n)
        if finish is None:
            return False
        self._finish(req, finish, now)
        return True

    # -- retraction ----------------------------------------------------------------------
    def _retract_for(self, pages_needed: int, now: float, result: StepResult) -> None:
        """Retract decoding requests, fewest output tokens first (longest prompt among
        equals), until the rest can each get the page they need."""
        kv, ps = self.kv, self.page_size
        order = sorted(self.decoding, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        victims: set[int] = set()
        for req in order:
            if pages_needed <= kv.available_pages or len(victims) == len(order) - 1:
                break
            if req.computed == req.tree_len + len(req.pages) * ps:
                pages_needed -= 1
            self._retract(req)
            victims.add(id(req))
            result.retracted.append(req)
        self.decoding = [r for r in self.decoding if id(r) not in victims]
        self.waiting[:0] = [r for r in order if id(r) in victims]
        while pages_needed > kv.available_pages and self.prefilling:
            self._requeue(self.prefilling.pop(), result)  # partial prefills give way too
        if pages_needed > kv.available_pages:
            # A single sequence the whole pool cannot hold: fail closed.
            doomed = list(self.decoding)
            for req in doomed:
                self._finish(req, aborted("The KV cache is exhausted.", 503), now)
            result.finished.extend(doomed)
            self.aborted_total += len(doomed)
        self.retracted_total += len(victims)
        self._last_retracted = len(victims)
        self.new_token_ratio = self.init_ratio

    def _retract(self, req: EngineRequest) -> None:
        self._release(req)
        req.computed = 0
        req.kv_imported = 0  # the transferred KV is gone: a recompute computes it all
        req.retractions += 1
        req.phase = Phase.WAITING

    def _requeue(self, req: EngineRequest, result: StepResult) -> None:
        self._retract(req)
        self.waiting.insert(0, req)
        result.retracted.append(req)

    # -- release -------------------------------------------------------------------------
    def _release(self, req: EngineRequest) -> None:
        """Give back the request's KV; its computed full pages stay cached (evictable), so
        a recompute or a continuation of the same history hits the prefix cache."""
        kv = self.kv
        if req.node is not None or req.pages:
            if req.phase is not Phase.WAITING:
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
        self._release(req)
        req.finish = finish
        req.phase = Phase.FINISHED
        self.requests.pop(req.rid, None)
        if phase is Phase.WAITING:
            self.waiting.remove(req)
        elif phase is Phase.PREFILL:
            self.prefilling.remove(req)
        elif phase is Phase.DECODE:
            self.decoding.remove(req)
