"""How often SGLang's CPU kernels make a resume differ from the uninterrupted greedy run.

    python -m tests.sglang.determinism 0.5.23

Runs one 500-token greedy request, then resumes it from its own first k tokens (the
prompt's ids plus k output ids, as Weir's sidecar resumes a preempted request) for 12
values of k, with the prefix cache flushed before each so that the prefix is recomputed
by prefill rather than found cached, and prints where each resumed run first differs.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from typing import Any

from tests.sglang.server import SGLangServer

PROMPT = "Once upon a time there was a tiny language model."
TOKENS = 500
RESUME_POINTS = (5, 8, 10, 13, 17, 25, 40, 60, 100, 150, 200, 300)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post(url: str, body: dict[str, Any] | None) -> Any:
    data = b"" if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with _OPENER.open(request, timeout=300) as reply:
        answer = reply.read()
    return json.loads(answer) if body is not None else None


def _greedy(url: str, prompt: dict[str, Any], tokens: int) -> list[int]:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    ids: list[int] = _post(url + "/generate", {**prompt, "sampling_params": params})["output_ids"]
    return ids


def main(version: str) -> int:
    with SGLangServer(version) as server:
        url = server.url
        probe = _post(url + "/generate", {
            "text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        })  # fmt: skip
        prompt = [entry[1] for entry in probe["meta_info"]["input_token_logprobs"]]
        straight = _greedy(url, {"input_ids": prompt}, TOKENS)
        differ = 0
        for k in RESUME_POINTS:
            _post(url + "/flush_cache", None)
            resumed = _greedy(url, {"input_ids": prompt + straight[:k]}, TOKENS - k)
            first = next(
                (k + i for i, (a, b) in enumerate(zip(resumed, straight[k:], strict=True))
                 if a != b),
                None,
            )  # fmt: skip
            differ += first is not None
            print(f"resumed at {k:3d}: " + ("same" if first is None else f"differs at {first}"))
        print(f"SGLang {version}: {differ} of {len(RESUME_POINTS)} resumes differ")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "0.5.23"))
