"""Reading the sidecar's server-sent events in tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from controlplane.contract import Continuation, decode_json


@dataclass
class Received:
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    continuation: Continuation | None = None

    def text(self) -> str:
        """The output as the client sees it: cumulative for /generate, joined deltas else."""
        if self.events and "meta_info" in self.events[-1]:
            return str(self.events[-1]["text"])
        parts = []
        for event in self.events:
            for choice in event.get("choices") or ():
                delta = choice.get("delta")
                parts.append(
                    (delta or {}).get("content") or ""
                    if delta is not None
                    else choice.get("text") or ""
                )
        return "".join(parts)

    def usage(self) -> list[dict[str, Any]]:
        """The counts the client was sent: every OpenAI usage object, or the token counts
        of /generate's last meta_info."""
        if self.events and "meta_info" in self.events[-1]:
            meta = self.events[-1]["meta_info"]
            return [{key: meta[key] for key in ("prompt_tokens", "completion_tokens")}]
        return [event["usage"] for event in self.events if event.get("usage")]

    def finish(self) -> object:
        for event in reversed(self.events):
            if "meta_info" in event:
                return event["meta_info"]["finish_reason"]
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    return choice["finish_reason"]
        return None


async def read_sse(resp: aiohttp.ClientResponse, stop_after: int = 0) -> Received:
    """Read events until [DONE], a `weir.preempted` event, or `stop_after` events."""
    got = Received()
    event_name = ""
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"event:"):
            event_name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
            if event_name == "weir.preempted":
                got.continuation = decode_json(data, Continuation)
                return got
            if data == b"[DONE]":
                got.done = True
                return got
            got.events.append(msgspec.json.decode(data))
            if stop_after and len(got.events) >= stop_after:
                return got
    return got
