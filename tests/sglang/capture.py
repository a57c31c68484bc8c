"""Records what a real SGLang server answers, as reference fixtures for the adapter and the
reference engine: `python -m tests.sglang.capture 0.5.23` (or 0.5.5) starts the
server (tests/sglang/server.py; install it first with scripts/sglang_env.py) and writes
small JSON files into tests/sglang/captures/<version>/.

Each capture is {"request": ..., "status": ..., "content_type": ..., "body": ...}: the body
parsed as JSON where it is JSON, else text; a stream keeps its exact bytes as text, events
in the middle elided where it is long. Timestamps and ids differ from run to run; the shapes,
status codes, keys and finish reasons are what the fixtures are for.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.sglang.server import SGLangServer

HERE = Path(__file__).resolve().parent
JSON_HEADERS = {"Content-Type": "application/json"}
PROMPT = "Hello, world! The quick brown fox"
OTHER_PROMPTS = [
    "Once upon a time",
    "The rain in Spain",
    "alpha beta gamma",
    "def main():",
    "Monday Tuesday",
    "She sells sea shells",
    "0123456789",
]


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> dict[str, Any]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        sent_headers = dict(JSON_HEADERS if headers is None else headers)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        started = time.monotonic()
        try:
            conn.request(method, path, body=data, headers=sent_headers)
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        text = payload.decode(errors="replace")
        parsed: Any
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return {
            "request": {
                "method": method,
                "path": path,
                "headers": sent_headers,
                "body": body if raw is None else raw.decode(errors="replace"),
            },
            "status": response.status,
            "content_type": response.getheader("Content-Type"),
            "body": parsed,
            "seconds": round(time.monotonic() - started, 3),
        }

    def stream(
        self,
        path: str,
        body: Any,
        *,
        on_event: Callable[[int], None] | None = None,
        timeout: float = 300,
    ) -> dict[str, Any]:
        """POSTs and reads the SSE answer line by line, keeping the exact bytes."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        started = time.monotonic()
        lines: list[str] = []
        events: list[Any] = []
        first_token_at: float | None = None
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=JSON_HEADERS)
            response = conn.getresponse()
            while True:
                line = response.readline()
                if not line:
                    break
                text = line.decode(errors="replace")
                lines.append(text)
                if text.startswith("data: "):
                    payload = text[len("data: ") :].strip()
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    events.append(payload if payload == "[DONE]" else _loads(payload))
                    if on_event is not None:
                        on_event(len(events))
        finally:
            conn.close()
        ended = time.monotonic()
        return {
            "request": {"method": "POST", "path": path, "body": body},
            "status": response.status,
            "headers": {
                key: value
                for key, value in response.getheaders()
                if key.lower() in ("content-type", "transfer-encoding", "content-length")
            },
            "raw": "".join(lines),
            "events": events,
            "seconds": round(ended - started, 3),
            "first_event_seconds": None
            if first_token_at is None
            else round(first_token_at - started, 3),
        }


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def trimmed(capture: dict[str, Any], keep: int = 2) -> dict[str, Any]:
    """A stream capture as saved: its exact text with only the first and last `keep`
    events (the parsed events are left out: they are the same data)."""
    out = {key: value for key, value in capture.items() if key != "events"}
    events = capture.get("events", [])
    out["event_count"] = len(events)
    blocks = capture.get("raw", "").split("\n\n")
    if len(blocks) > 2 * keep + 1:
        skipped = len(blocks) - 2 * keep - 1
        out["raw"] = "\n\n".join(
            [*blocks[:keep], f"... {skipped} events left out ...", *blocks[-keep - 1 :]]
        )
    return out


class Recorder:
    def __init__(self, version: str) -> None:
        self.folder = HERE / "captures" / version
        self.folder.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = {}

    def save(self, name: str, data: Any) -> None:
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
        print(f"  {path.relative_to(HERE)} ({path.stat().st_size} bytes)", flush=True)


def gen(prompt: str, max_new: int, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new, "temperature": 0, **extra.pop("sampling", {})}
    return {"text": prompt, "sampling_params": sampling, "stream": stream, **extra}


def run_stream_in_thread(
    client: Client, path: str, body: Any, wait_events: int
) -> tuple[threading.Thread, dict[str, Any], threading.Event, list[int]]:
    """Starts a stream; returns (thread, result holder, event set after `wait_events`
    events, event count holder)."""
    holder: dict[str, Any] = {}
    reached = threading.Event()
    count = [0]

    def on_event(n: int) -> None:
        count[0] = n
        if n >= wait_events:
            reached.set()

    def target() -> None:
        holder.update(client.stream(path, body, on_event=on_event))
        reached.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, holder, reached, count


def capture(version: str, only: str | None = None) -> None:
    """Every capture, or with `only="hostile"` just that one (its summary entry merged
    into the existing summary.json: it restarts the server for each value that ends it)."""
    rec = Recorder(version)
    if only is not None:
        with contextlib.suppress(OSError, ValueError):
            rec.summary = json.loads((rec.folder / "summary.json").read_text())
    log_dir = Path("/tmp") / f"weir-sglang-capture-{version}"
    with SGLangServer(version, log_dir=log_dir) as server:
        print(f"SGLang {version} up in {server.start_seconds:.1f} s at {server.url}", flush=True)
        c = Client(server.port)
        if only == "hostile":
            hostile(c, rec, server)
            rec.save("summary", rec.summary)
            return
        if only is not None:
            raise SystemExit(f"--only takes 'hostile', not {only!r}")
        rec.summary["start_seconds"] = round(server.start_seconds or 0, 1)
        rec.summary["command"] = server.command()[1:]
        info(c, rec)
        generate(c, rec)
        openai(c, rec)
        abort(c, rec)
        pause(c, rec, version)
        bad_input(c, rec)
        determinism(c, rec)
        throughput(c, rec, server)
        metrics(c, rec)
        hostile(c, rec, server)
        rec.save("summary", rec.summary)


def info(c: Client, rec: Recorder) -> None:
    """/get_server_info in full (compact); of /server_info only whether it is the same."""
    full = c.request("GET", "/get_server_info")
    same = c.request("GET", "/server_info")
    (rec.folder / "get_server_info.json").write_text(json.dumps(full, separators=(",", ":")) + "\n")
    body = full["body"]
    internal = (body.get("internal_states") or [{}])[0]
    rec.summary["/get_server_info"] = {
        "status": full["status"],
        **{
            key: body.get(key, "<absent>")
            for key in (
                "version",
                "max_total_num_tokens",
                "page_size",
                "context_length",
                "max_req_input_len",
                "chunked_prefill_size",
                "max_running_requests",
                "dtype",
                "status",
            )
        },
        "launch_arg_count": len(set(internal) & set(body)),
        "top_level_only": sorted(set(body) - set(internal)),
        "internal_states[0]_only": {key: internal[key] for key in set(internal) - set(body)},
    }
    rec.summary["/server_info"] = {"status": same["status"]}
    if same["status"] == 200:
        rec.summary["/server_info"]["same_keys_and_values_as_get_server_info"] = same[
            "body"
        ] == body or sorted(k for k in body if body.get(k) != (same["body"] or {}).get(k))
    statuses = {}
    for path in (
        "/get_load",
        "/v1/loads",
        "/v1/loads?include=all",
        "/health",
        "/health_generate",
        "/ready",
        "/get_model_info",
        "/model_info",
        "/v1/models",
        "/flush_cache",
    ):
        method = "POST" if path == "/flush_cache" else "GET"
        answer = c.request(method, path)
        statuses[path] = answer["status"]
        if path in ("/get_load", "/v1/loads?include=all", "/get_model_info", "/v1/models"):
            rec.save(path.strip("/").replace("/", "_").replace("?", "_"), answer)
    rec.summary["endpoint_status"] = statuses


def generate(c: Client, rec: Recorder) -> None:
    length = c.request("POST", "/generate", gen(PROMPT, 8))
    rec.save("generate_unary_length", length)
    eos = c.request("POST", "/generate", gen(PROMPT, 400))
    rec.save("generate_unary_eos", eos)
    first = length["body"]["text"] if length["status"] == 200 else "x"
    stop_word = first[2:4] if len(first) >= 4 else first
    stop = c.request("POST", "/generate", gen(PROMPT, 64, sampling={"stop": [stop_word]}))
    rec.save("generate_unary_stop_string", stop)
    streamed = c.stream("/generate", gen(PROMPT, 8, stream=True))
    rec.save("generate_stream_length", trimmed(streamed))
    streamed_eos = c.stream("/generate", gen(PROMPT, 400, stream=True))
    rec.save("generate_stream_eos", trimmed(streamed_eos))
    ids = c.request(
        "POST",
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "rid": "weir-input-ids-0001",
        },
    )
    rec.save("generate_input_ids_with_rid", ids)
    no_header = c.request("POST", "/generate", gen(PROMPT, 2), headers={})
    rec.save("generate_without_content_type", no_header)
    rec.summary["generate"] = {
        "finish_reasons": {
            "length": length["body"]["meta_info"]["finish_reason"],
            "eos": eos["body"]["meta_info"]["finish_reason"],
            "stop_string": stop["body"]["meta_info"]["finish_reason"],
        },
        "meta_info_keys_unary": sorted(length["body"]["meta_info"]),
        "meta_info_keys_stream_first": sorted(streamed["events"][0]["meta_info"]),
        "meta_info_keys_stream_last": sorted(streamed["events"][-2]["meta_info"]),
        "stream_last_line": streamed["raw"].splitlines()[-1:],
        "stream_text_cumulative": [e["text"] for e in streamed["events"][:-1]],
        "without_content_type": no_header["status"],
    }


def openai(c: Client, rec: Recorder) -> None:
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    comp = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    out: dict[str, Any] = {}
    for name, path, body in (
        ("chat", "/v1/chat/completions", chat),
        ("completions", "/v1/completions", comp),
    ):
        unary = c.request("POST", path, body)
        rec.save(f"openai_{name}_unary", unary)
        plain = c.stream(path, {**body, "stream": True})
        rec.save(f"openai_{name}_stream", trimmed(plain))
        usage = c.stream(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        rec.save(f"openai_{name}_stream_usage", trimmed(usage))
        extra = c.request(
            "POST",
            path,
            {**body, "rid": f"weir-openai-{name}-01", "priority": 3, "cache_salt": "s1"},
        )
        rec.save(f"openai_{name}_rid_priority_salt", extra)
        out[name] = {
            "unary_finish_reason": unary["body"]["choices"][0].get("finish_reason"),
            "unary_usage": unary["body"].get("usage"),
            "stream_last_events": plain["events"][-3:],
            "usage_stream_last_events": usage["events"][-3:],
            "rid_priority_salt_status": extra["status"],
        }
    rec.summary["openai"] = out


def abort(c: Client, rec: Recorder) -> None:
    rid = "weir-abort-target-000001"
    body = gen(PROMPT, 3000, stream=True, rid=rid, sampling={"ignore_eos": True})
    thread, holder, reached, _ = run_stream_in_thread(c, "/generate", body, 5)
    reached.wait(120)
    answer = c.request("POST", "/abort_request", {"rid": rid})
    thread.join(120)
    rec.save("abort_request_answer", answer)
    rec.save("abort_stream", trimmed(holder))
    # Prefix: does "weir-abort-pre" abort "weir-abort-prefix-0000002"?
    rid2 = "weir-abort-prefix-0000002"
    body2 = gen(PROMPT, 400, stream=True, rid=rid2, sampling={"ignore_eos": True})
    thread2, holder2, reached2, _ = run_stream_in_thread(c, "/generate", body2, 5)
    reached2.wait(120)
    prefix_answer = c.request("POST", "/abort_request", {"rid": "weir-abort-pre"})
    thread2.join(300)
    rec.save("abort_by_prefix_stream", trimmed(holder2))
    unknown = c.request("POST", "/abort_request", {"rid": "weir-no-such-request"})
    all_answer = c.request("POST", "/abort_request", {"abort_all": True})
    unary_rid = "weir-abort-unary-00000003"
    holder3: dict[str, Any] = {}

    def unary() -> None:
        holder3.update(
            c.request(
                "POST", "/generate", gen(PROMPT, 3000, rid=unary_rid, sampling={"ignore_eos": True})
            )
        )

    t3 = threading.Thread(target=unary, daemon=True)
    t3.start()
    time.sleep(2)
    c.request("POST", "/abort_request", {"rid": unary_rid})
    t3.join(120)
    rec.save(
        "abort_unary_generate",
        {**holder3, "body": {"meta_info": (holder3.get("body") or {}).get("meta_info")}},
    )
    rec.summary["abort"] = {
        "answer": [answer["status"], answer["body"]],
        "stream_status": holder.get("status"),
        "stream_last_lines": holder.get("raw", "").splitlines()[-4:],
        "finish_reason": _last_finish(holder),
        "prefix_answer": prefix_answer["status"],
        "prefix_aborted": _last_finish(holder2),
        "prefix_completion_tokens": _last_meta(holder2).get("completion_tokens"),
        "unknown_rid": [unknown["status"], unknown["body"]],
        "abort_all": [all_answer["status"], all_answer["body"]],
        "unary_abort": [
            holder3.get("status"),
            ((holder3.get("body") or {}).get("meta_info") or {}).get("finish_reason"),
        ],
    }


def _short(body: Any, limit: int = 240) -> Any:
    """A summary's copy of an answer: the full one is in its own capture file."""
    text = json.dumps(body)
    return body if len(text) <= limit else text[:limit] + " ..."


def _load_digest(body: Any) -> Any:
    """The few load fields worth comparing (the whole answer is in the loads capture)."""
    keys = (
        "timestamp",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "num_reqs",
        "num_tokens",
        "queues",
    )
    loads = body.get("loads") if isinstance(body, dict) else body
    if not isinstance(loads, list):
        return body
    digest: dict[str, Any] = {"loads": [{k: load[k] for k in keys if k in load} for load in loads]}
    if isinstance(body, dict):
        digest["timestamp"] = body.get("timestamp")
    return digest


def _last_meta(stream: dict[str, Any]) -> dict[str, Any]:
    for event in reversed(stream.get("events", [])):
        if isinstance(event, dict) and "meta_info" in event:
            meta: dict[str, Any] = event["meta_info"]
            return meta
    return {}


def _last_finish(stream: dict[str, Any]) -> Any:
    return _last_meta(stream).get("finish_reason")


def pause(c: Client, rec: Recorder, version: str) -> None:
    results: dict[str, Any] = {}
    modes: list[str | None] = ["abort", "retract", "in_place"] if version != "0.5.5" else [None]
    for mode in modes:
        name = mode or "nobody"
        rid = f"weir-pause-{name:>8}-0001".replace(" ", "x")
        body = gen(PROMPT, 120, stream=True, rid=rid, sampling={"ignore_eos": True})
        thread, holder, reached, count = run_stream_in_thread(c, "/generate", body, 5)
        reached.wait(120)
        pause_body = None if mode is None else {"mode": mode}
        paused = c.request("POST", "/pause_generation", pause_body)
        at_pause = count[0]
        time.sleep(3)
        after_3s = count[0]
        while_paused = c.request(
            "GET", "/v1/loads?include=all" if version != "0.5.5" else "/get_load"
        )
        resumed = c.request("POST", "/continue_generation", {})
        thread.join(300)
        rec.save(f"pause_{name}_stream", trimmed(holder))
        results[name] = {
            "pause_answer": [paused["status"], paused["body"]],
            "events_at_pause": at_pause,
            "events_3s_later": after_3s,
            "load_while_paused": _load_digest(while_paused["body"]),
            "continue_answer": [resumed["status"], resumed["body"]],
            "final_events": holder.get("event_count", len(holder.get("events", []))),
            "finish_reason": _last_finish(holder),
            "completion_tokens": _last_meta(holder).get("completion_tokens"),
            "retractions": {k: v for k, v in _last_meta(holder).items() if "retract" in k},
        }
    # The known bug: continue with an empty body.
    pause_body = None if version == "0.5.5" else {"mode": "abort"}
    paused = c.request("POST", "/pause_generation", pause_body)
    empty = c.request("POST", "/continue_generation", raw=b"")
    hung: dict[str, Any] = {}

    def probe_generate() -> None:
        hung.update(c.request("POST", "/generate", gen(PROMPT, 2), timeout=120))

    t = threading.Thread(target=probe_generate, daemon=True)
    t.start()
    t.join(8)
    hung_after_empty = t.is_alive()
    fixed = c.request("POST", "/continue_generation", {})
    t.join(60)
    no_body_pause = None
    if version != "0.5.5":
        no_body_pause = c.request("POST", "/pause_generation", raw=b"")
        c.request("POST", "/continue_generation", {})
    rec.save("continue_generation_empty_body", empty)
    results["continue_empty_body"] = {
        "pause_answer": [paused["status"], paused["body"]],
        "empty_body_answer": [empty["status"], empty["body"]],
        "generate_still_waiting_8s_later": hung_after_empty,
        "continue_with_braces": [fixed["status"], fixed["body"]],
        "generate_after_braces": [hung.get("status"), (hung.get("body") or {}).get("text")],
        "pause_with_empty_body": None
        if no_body_pause is None
        else [no_body_pause["status"], no_body_pause["body"]],
    }
    flush_busy: dict[str, Any] = {}
    body = gen(PROMPT, 200, stream=True, sampling={"ignore_eos": True})
    thread, holder, reached, _ = run_stream_in_thread(c, "/generate", body, 3)
    reached.wait(120)
    flush_busy = c.request("POST", "/flush_cache")
    thread.join(300)
    results["flush_cache_while_running"] = [flush_busy["status"], flush_busy["body"]]
    rec.summary["pause"] = results


def bad_input(c: Client, rec: Recorder) -> None:
    long_ids = list(range(3, 503)) * 10  # 5,000 tokens, context 4,096
    long_text = "The quick brown fox jumps over the lazy dog. " * 600
    out: dict[str, Any] = {}
    cases: list[tuple[str, str, Any, bytes | None]] = [
        (
            "too_long_generate_ids",
            "/generate",
            {"input_ids": long_ids, "sampling_params": {"max_new_tokens": 4}},
            None,
        ),
        ("too_long_generate_text", "/generate", gen(long_text, 4), None),
        (
            "too_long_chat",
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": long_text}],
                "max_tokens": 4,
            },
            None,
        ),
        (
            "too_long_completions",
            "/v1/completions",
            {"model": "default", "prompt": long_text, "max_tokens": 4},
            None,
        ),
        ("max_new_tokens_over_context", "/generate", gen(PROMPT, 100000), None),
        ("malformed_generate", "/generate", None, b'{"text": "hi", '),
        ("malformed_chat", "/v1/chat/completions", None, b'{"model": '),
        ("malformed_completions", "/v1/completions", None, b"not json"),
        ("malformed_abort", "/abort_request", None, b"{rid"),
        ("malformed_pause", "/pause_generation", None, b"{mode"),
        ("chat_missing_messages", "/v1/chat/completions", {"model": "default"}, None),
        ("generate_missing_text", "/generate", {"sampling_params": {"max_new_tokens": 2}}, None),
        ("generate_negative_max_new", "/generate", gen(PROMPT, -1), None),
    ]
    for name, path, body, raw in cases:
        answer = c.request("POST", path, body, raw=raw, timeout=120)
        if (
            isinstance(answer["request"]["body"], dict | str)
            and len(json.dumps(answer["request"]["body"])) > 400
        ):
            answer["request"]["body"] = f"<{len(json.dumps(answer['request']['body']))} chars>"
        rec.save(f"bad_{name}", answer)
        if path == "/pause_generation":
            # 0.5.5 ignores the body: a malformed one pauses the engine all the same.
            answer["continue_answer"] = c.request("POST", "/continue_generation", {})["status"]
        body_out = answer["body"]
        if isinstance(body_out, dict) and "meta_info" in body_out:
            body_out = {
                "meta_info.finish_reason": body_out["meta_info"].get("finish_reason"),
                "completion_tokens": body_out["meta_info"].get("completion_tokens"),
            }
        out[name] = [
            answer["status"],
            _short(body_out),
            *(
                [{"then /continue_generation {}": answer["continue_answer"]}]
                if "continue_answer" in answer
                else []
            ),
        ]
    # A long prompt in a stream: the error before or inside the stream?
    streamed = c.stream("/generate", gen(long_text, 4, stream=True))
    streamed["request"]["body"] = "<long text>"
    rec.save("bad_too_long_generate_stream", trimmed(streamed))
    out["too_long_generate_stream"] = [streamed["status"], streamed["raw"][:600]]
    rec.summary["bad_input"] = out


def determinism(c: Client, rec: Recorder) -> None:
    def ids(prompt: str) -> list[int]:
        answer = c.request("POST", "/generate", gen(prompt, 48, sampling={"ignore_eos": True}))
        out: list[int] = answer["body"]["output_ids"]
        return out

    alone = [ids(PROMPT) for _ in range(3)]
    batched_runs = []
    for _ in range(2):
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ids, [PROMPT, *OTHER_PROMPTS]))
        batched_runs.append(results)
    others_alone = [ids(p) for p in OTHER_PROMPTS]
    rec.summary["determinism"] = {
        "alone_runs_equal": all(run == alone[0] for run in alone),
        "batched_equal_alone": [run[0] == alone[0] for run in batched_runs],
        "others_batched_equal_alone": [
            [a == b for a, b in zip(run[1:], others_alone, strict=True)] for run in batched_runs
        ],
        "first_divergence_batched": [
            next((i for i, (a, b) in enumerate(zip(run[0], alone[0], strict=True)) if a != b), None)
            for run in batched_runs
        ],
        "alone_ids": alone[0],
    }


def throughput(c: Client, rec: Recorder, server: SGLangServer) -> None:
    body = gen(PROMPT, 256, stream=True, sampling={"ignore_eos": True})
    one = c.stream("/generate", body)
    tokens = _last_meta(one).get("completion_tokens", 0)
    decode_s = one["seconds"] - (one["first_event_seconds"] or 0)
    with ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        runs = list(pool.map(lambda _: c.stream("/generate", body), range(8)))
        wall = time.monotonic() - started
    total = sum(_last_meta(run).get("completion_tokens", 0) for run in runs)
    rss_kib = server.rss_bytes() // 1024
    rec.summary["throughput"] = {
        "one_stream_tokens": tokens,
        "one_stream_seconds": one["seconds"],
        "one_stream_tok_per_s_after_first": round(tokens / decode_s, 1) if decode_s else None,
        "one_stream_tok_per_s_wall": round(tokens / one["seconds"], 1),
        "eight_streams_tokens": total,
        "eight_streams_seconds": round(wall, 2),
        "eight_streams_tok_per_s": round(total / wall, 1),
        "server_rss_mib": round(rss_kib / 1024),
    }


# Families whose first sample line (with SGLang's labels) is kept in the capture.
SAMPLED_FAMILIES = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
        "sglang:prompt_tokens_total",
        "sglang:time_to_first_token_seconds",
    }
)


def metric_families(text: str) -> dict[str, dict[str, str]]:
    """Each family of a Prometheus exposition: its type and its first sample line (the
    labels SGLang puts on it)."""
    families: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = {"type": kind}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in ("", "_total", "_count", "_sum", "_bucket", "_created"):
            base = sample.removesuffix(suffix) if suffix else sample
            if base in families and "first_sample" not in families[base]:
                families[base]["first_sample"] = line
                break
            if f"{base}_total" in families and "first_sample" not in families[f"{base}_total"]:
                families[f"{base}_total"]["first_sample"] = line
                break
    return families


def metrics(c: Client, rec: Recorder) -> None:
    answer = c.request("GET", "/metrics")
    text = answer["body"] if isinstance(answer["body"], str) else ""
    families = metric_families(text)
    for name, family in families.items():
        if name not in SAMPLED_FAMILIES:
            family.pop("first_sample", None)
    rec.save(
        "metrics_families",
        {"status": answer["status"], "content_type": answer["content_type"], "families": families},
    )
    rec.summary["metrics"] = {"status": answer["status"], "families": len(families)}


HOSTILE: list[tuple[str, bytes]] = [
    (
        "negative_temperature",
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": -1}}',
    ),
    (
        "inf_temperature",
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 1e999}}',
    ),
    (
        "huge_max_new_tokens",
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 100000000000000000000}}',
    ),
    ("string_max_new_tokens", b'{"text": "hi", "sampling_params": {"max_new_tokens": "2"}}'),
    ("negative_top_k", b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": -5}}'),
    ("zero_top_p", b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_p": 0}}'),
    ("text_is_number", b'{"text": 5, "sampling_params": {"max_new_tokens": 2}}'),
    (
        "out_of_vocab_input_ids",
        b'{"input_ids": [100000], "sampling_params": {"max_new_tokens": 2}}',
    ),
    ("negative_input_ids", b'{"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}}'),
    # Last: `NaN` is not JSON, but Python's json module reads it.
    (
        "nan_temperature",
        b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}',
    ),
]


def hostile(c: Client, rec: Recorder, server: SGLangServer) -> None:
    """Hostile values, each followed by a health check; a value that ends the server is
    recorded and the server started again for the next one."""
    results: dict[str, Any] = {}
    for name, raw in HOSTILE:
        try:
            answer: dict[str, Any] = c.request("POST", "/generate", raw=raw, timeout=60)
        except (OSError, http.client.HTTPException) as exc:
            answer = {
                "request": {"path": "/generate", "body": raw.decode()},
                "error": f"{type(exc).__name__}: {exc}",
            }
        time.sleep(1)
        try:
            health: Any = c.request("GET", "/health", timeout=30)["status"]
        except (OSError, http.client.HTTPException) as exc:
            health = f"{type(exc).__name__}: {exc}"
        alive = server.running()
        body = answer.get("body")
        if isinstance(body, dict) and "meta_info" in body:
            body = {
                "text": body.get("text"),
                "finish_reason": body["meta_info"].get("finish_reason"),
            }
        results[name] = {
            "request": raw.decode(),
            "status": answer.get("status"),
            "body": body,
            "error": answer.get("error"),
            "health": health,
            "server_process_alive": alive,
        }
        if not alive or health != 200:
            crash = [
                line
                for line in server.log_tail(200).splitlines()
                if line.startswith(("IndexError", "RuntimeError", "ValueError", "AssertionError"))
            ]
            results[name]["server_log_error"] = crash[-1:] or server.log_tail(3)
            server.stop()
            server.start()
            results[name]["server_restarted"] = True
    rec.save("bad_hostile_values", results)
    rec.summary["hostile"] = {
        name: [result["status"], result["error"], result["health"]]
        for name, result in results.items()
    }


if __name__ == "__main__":
    arguments = sys.argv[1:] or ["0.5.23"]
    chosen = arguments[arguments.index("--only") + 1] if "--only" in arguments else None
    for requested in arguments:
        if requested.startswith("0."):
            capture(requested, chosen)
