"""Replaying production traces: Mooncake (FAST'25) JSONL and Azure LLM inference CSV.

Mooncake lines are `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}` where each hash id names one 512-token prompt block, so prefix reuse
survives replay exactly. Azure's CSV has `TIMESTAMP, ContextTokens, GeneratedTokens` and
no prefix information: every prompt is unique. Arrival times are rebased to start at zero
and may be compressed (`speedup` > 1) to raise the offered load; `limit` keeps the first
requests only. Bad lines raise `TraceError` naming the line, instead of being skipped.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

from fleetsim.workloads.misprediction import with_output_hints
from fleetsim.workloads.request import BLOCK_TOKENS, RequestSpec

TRACE_TENANT = "trace"
LONG_INPUT_TOKENS = 8192
LONG_OUTPUT_TOKENS = 1024


def write_trace(specs: Iterable[RequestSpec], path: str | Path) -> int:
    """Write requests as a Mooncake JSONL trace (arrival in ms, lengths, block ids as
    `hash_ids`), the format `read_trace` replays: a synthetic trace of any size from a
    scenario's traffic. Tenants, priorities, deadlines and cancellations are not part of
    the format and are not written. Returns the number of lines written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as handle:
        for spec in specs:
            record = {
                "timestamp": round(spec.arrival_s * 1000.0, 3),
                "input_length": spec.input_tokens,
                "output_length": spec.generated_tokens,
                "hash_ids": list(spec.block_ids),
            }
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
            count += 1
    return count


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names file and line."""


def read_trace(
    path: str | Path,
    *,
    speedup: float = 1.0,
    limit: int = 0,
    output_hint_bias: float = 0.0,
) -> list[RequestSpec]:
    """Read a trace, choosing the format by content: JSON lines or Azure CSV."""
    if not math.isfinite(speedup) or speedup <= 0:
        raise ValueError(f"speedup must be a positive number, got {speedup}")
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        lines = handle.read().splitlines(keepends=True)
    first = next((line.lstrip() for line in lines if line.strip()), "")
    if not first:
        raise TraceError(f"{path}: no requests")
    if first.startswith("{"):
        rows = list(_mooncake_rows(lines, path))
    else:
        rows = list(_azure_rows(lines, path))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    if limit > 0:
        rows = rows[:limit]
    start = rows[0][0]
    specs = [
        _spec(f"trace-{i:07d}", (at - start) / speedup, inp, out, blocks)
        for i, (at, inp, out, blocks) in enumerate(rows)
    ]
    return with_output_hints(specs, output_hint_bias)


_Row = tuple[float, int, int, tuple[int, ...] | None]


def _mooncake_rows(lines: Iterable[str], path: Path) -> Iterator[_Row]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected an object")
        at = _number(record, "timestamp", where) / 1000.0
        inp = _count(record, "input_length", where)
        out = _count(record, "output_length", where)
        hashes = record.get("hash_ids")
        blocks: tuple[int, ...] | None = None
        if hashes is not None:
            if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hashes
            ):
                raise TraceError(f"{where}: hash_ids must be a list of non-negative ints")
            blocks = tuple(hashes)
        yield at, inp, out, blocks


def _azure_rows(lines: Iterable[str], path: Path) -> Iterator[_Row]:
    reader = csv.DictReader(lines)
    fields = {f.strip() for f in reader.fieldnames or ()}
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - fields
    if missing:
        raise TraceError(f"{path}: not a Mooncake JSONL or Azure CSV trace (missing {missing})")
    for number, raw in enumerate(reader, 2):
        row = {k.strip(): (v or "").strip() for k, v in raw.items() if k}
        where = f"{path}:{number}"
        try:
            at = _azure_time(row["TIMESTAMP"])
            inp = int(row["ContextTokens"])
            out = int(row["GeneratedTokens"])
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
        if inp <= 0 or out < 0:
            raise TraceError(f"{where}: token counts must be positive")
        yield at, inp, max(1, out), None


def _azure_time(text: str) -> float:
    """Azure's timestamps carry 7 fractional digits, more than `fromisoformat` accepts."""
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text).timestamp()


def _number(record: dict[str, object], key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: {key} must be a finite number, got {value!r}")
    if value < 0:
        raise TraceError(f"{where}: {key} must not be negative")
    return float(value)


def _count(record: dict[str, object], key: str, where: str) -> int:
    value = _number(record, key, where)
    if value != int(value) or value < 1:
        raise TraceError(f"{where}: {key} must be a positive integer, got {record.get(key)!r}")
    return int(value)


_UNIQUE_BASE = 1 << 40
"""Block ids for prompt tail blocks a trace does not name; far above any trace's ids."""


def _spec(
    request_id: str, at: float, inp: int, out: int, blocks: tuple[int, ...] | None
) -> RequestSpec:
    need = -(-inp // BLOCK_TOKENS)
    named = blocks[:need] if blocks else ()
    serial = int(request_id.rsplit("-", 1)[1])
    tail = tuple(_UNIQUE_BASE + serial * 4096 + k for k in range(need - len(named)))
    long = inp >= LONG_INPUT_TOKENS or out >= LONG_OUTPUT_TOKENS
    return RequestSpec(
        request_id=request_id,
        arrival_s=at,
        tenant=TRACE_TENANT,
        priority=1,
        input_tokens=inp,
        output_tokens=out,
        max_tokens=out,
        block_ids=named + tail,
        category="long" if long else "short",
        tags=("long",) if long else ("short",),
    )
