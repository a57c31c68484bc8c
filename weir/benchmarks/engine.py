"""`weir bench engine`: how fast the reference engine simulates and serves.

- engine-model iterations/s and decode tokens per CPU-second for a 64-sequence decode
  batch (goal ≥ 50,000: a fleet simulation of a million requests must run in minutes),
  against a baseline of the bare token function over the same tokens in the same process;
- the HTTP server's streamed tokens/s (SSE over loopback, many concurrent streams, the
  simulated GPU infinitely fast) against the engine model alone.
"""

from __future__ import annotations

import argparse
import time

from weir.benchmarks._report import Figure, Report, add_output_flags, median_p99

NAME = "engine"
HELP = "Reference engine: model iterations/s, decode tokens per CPU-second, HTTP tokens/s."

GOAL_TOKENS_PER_CPU_S = 50_000.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser)
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences")
    parser.add_argument("--steps", type=int, default=2000, help="decode iterations per run")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--streams", type=int, default=32, help="concurrent HTTP streams")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens per stream")


def _model_run(batch: int, steps: int, page_size: int) -> tuple[float, float]:
    """(iterations per CPU-second, decode tokens per CPU-second) of a decode batch."""
    from fleetsim.engine import EngineConfig, EngineModel, encode

    prompt = 512
    model = EngineModel(
        EngineConfig(max_total_tokens=batch * (prompt + steps + 64), page_size=page_size)
    )
    for i in range(batch):
        req = model.make_request(f"b{i:04d}", encode(f"{i:04d}") * (prompt // 4), steps + 16,
                                 ignore_eos=True)  # fmt: skip
        model.submit(req, 0.0)
    now = 0.0
    while len(model.decoding) < batch:
        now += model.step(now).duration
    tokens = 0
    start = time.process_time()
    for _ in range(steps):
        result = model.step(now)
        now += result.duration
        tokens += result.decode_tokens
    cpu = time.process_time() - start
    return steps / cpu, tokens / cpu


def _token_function_run(tokens: int) -> float:
    """Tokens per CPU-second of the bare token function (the floor any engine pays)."""
    from fleetsim.engine.tokens import TokenFunction, extend_hash

    nxt = TokenFunction().next_token
    state = 1
    start = time.process_time()
    for _ in range(tokens):
        state = extend_hash(state, nxt(state, True))
    return tokens / (time.process_time() - start)


async def _http_run(streams: int, tokens: int) -> float:
    """Streamed tokens per wall-second through /generate SSE over loopback."""
    import asyncio
    import json

    import aiohttp

    from fleetsim.engine import EngineConfig
    from fleetsim.server import serve_engine

    config = EngineConfig(max_total_tokens=streams * (tokens + 64) * 2, speed_factor=1e9)
    async with serve_engine(config) as engine, aiohttp.ClientSession() as http:

        async def one(i: int) -> int:
            body = {
                "text": f"stream {i}",
                "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            }
            last = b"{}"
            async with http.post(f"{engine.url}/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        last = line[len(b"data: ") :]
            meta = json.loads(last).get("meta_info", {})
            return int(meta.get("completion_tokens", 0))

        start = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(streams)))
        elapsed = time.perf_counter() - start
    return sum(got) / elapsed


def run(args: argparse.Namespace) -> int:
    import asyncio

    report = Report(
        NAME,
        params={
            "batch": args.batch,
            "steps": args.steps,
            "page_size": args.page_size,
            "streams": args.streams,
            "stream_tokens": args.stream_tokens,
            "runs": args.runs,
        },
    )
    iters, toks, floor, http = [], [], [], []
    for _ in range(args.runs):
        i, t = _model_run(args.batch, args.steps, args.page_size)
        iters.append(i)
        toks.append(t)
        floor.append(_token_function_run(args.batch * args.steps))
        http.append(asyncio.run(_http_run(args.streams, args.stream_tokens)))
    # Throughputs: the p99 column holds the slowest run, the figure one can count on.
    it_med, _ = median_p99(iters)
    tok_med, _ = median_p99(toks)
    floor_med, _ = median_p99(floor)
    http_med, _ = median_p99(http)
    report.add(Figure("model_iterations_per_cpu_s", it_med, "iter/s", min(iters)))
    report.add(
        Figure(
            "model_decode_tokens_per_cpu_s",
            tok_med,
            "tok/s",
            min(toks),
            goal=f">= {GOAL_TOKENS_PER_CPU_S:,.0f}",
            met=tok_med >= GOAL_TOKENS_PER_CPU_S,
            note=f"{tok_med / floor_med:.2f}x the bare token function ({floor_med:,.0f} tok/CPU-s)",
        )
    )
    report.add(
        Figure(
            "http_streamed_tokens_per_s",
            http_med,
            "tok/s",
            min(http),
            note=f"SSE /generate, {args.streams} streams; {http_med / tok_med:.3f}x the model alone",
        )
    )
    report.emit(args.json)
    return 0
