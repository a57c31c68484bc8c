"""The reference engine model: SGLang's scheduler over a paged KV pool, on any clock.

One model, two clocks. The HTTP server (`fleetsim.server`) drives it in real time, sleeping
each iteration's duration over the speed factor; the fleet simulator drives it in virtual
time. The model never reads a clock: every call takes `now` (seconds, any origin).

    from fleetsim.engine import EngineConfig, EngineModel

    engine = EngineModel(EngineConfig(max_total_tokens=65536, page_size=16))
    req = engine.make_request("rid-1", input_ids, max_new_tokens=128, ignore_eos=True,
                              min_new_tokens=0, stop=(), priority=0, cache_salt="",
                              now=now)                  # EngineRequestError (→ 400) on bad input;
                                                        #   max_new_tokens clipped to fit
    if not engine.submit(req, now):                     # False: queue full, req.finish is
        ...                                             #   an abort with status_code 503
    while engine.has_work:
        result = engine.step(now)                       # one iteration
        now += result.duration                          # roofline seconds (not / speed)
        for r in result.admitted: ...                   # left the queue for a prefill
        for r in result.emitted: ...                    # each got one token: r.output_ids[-1]
        for r in result.finished: ...                   # r.finish: Finish(kind=stop|length|abort)
        for r in result.retracted: ...                  # KV freed, requeued at the tail
    engine.abort("rid-")                                # SGLang's scheduler: every rid with
                                                        #   this prefix; returns them
    engine.abort_request(req, now)                      # exactly this one (client gone)
    engine.loads()                                      # Loads: running, waiting, KV tokens…
    engine.pause("abort" | "retract" | "in_place", now); engine.resume()
    engine.flush_cache()                                # False while requests are live
    engine.check()                                      # assert pool/refcount invariants

The scheduling follows SGLang's own (`EngineConfig.sglang_version` picks 0.5.5's or
0.5.23's details); docs/reference-engine.md says how it is held to the real server and
what differs.

Speed: a 64-sequence decode batch simulates ~500k tokens per CPU-second (`weir bench
engine`); prompts hash at C speed and the prefix cache is a compressed radix tree (one node
per run of pages), so admission and caching cost little per request at any page size.

Requests (`EngineRequest`) carry `input_ids` (byte tokens: `tokens.encode(text)`),
`output_ids`, `finish`, `computed` (tokens with KV), `cached_tokens`, `retractions`, and
timestamps (`arrival`, `admitted_at`, `first_token_at`, `finished_at`). Tokens are a pure
function of the whole token prefix (`tokens.TokenFunction`), so a continuation (prompt +
generated so far) continues exactly as the uninterrupted request would.
"""

from fleetsim.engine.config import EngineConfig
from fleetsim.engine.request import EngineRequest, Finish, Phase
from fleetsim.engine.scheduler import EngineModel, EngineRequestError, Loads, StepResult
from fleetsim.engine.timing import H200, LLAMA_8B, HardwareProfile, ModelProfile, TimingModel
from fleetsim.engine.tokens import EOS_ID, decode, encode

__all__ = [
    "EOS_ID",
    "H200",
    "LLAMA_8B",
    "EngineConfig",
    "EngineModel",
    "EngineRequest",
    "EngineRequestError",
    "Finish",
    "HardwareProfile",
    "Loads",
    "ModelProfile",
    "Phase",
    "StepResult",
    "TimingModel",
    "decode",
    "encode",
]
