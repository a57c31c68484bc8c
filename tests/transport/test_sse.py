"""Server-sent-event framing: the same events however the bytes are cut, and the field
rules of the SSE format (one leading space dropped, comments and empty frames skipped)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from controlplane.transport import SSEFramer

FRAMES = [
    b'data: {"text": "a", "output_ids": [1, 2, 3]}\n\n',
    b": a comment, a keep-alive\n\n",
    b"event: weir.preempted\ndata: {}\n\n",
    b'data:{"no": "space"}\n\n',
    b"data:  two spaces\n\n",
    b"data: line one\ndata: line two\n\n",
    b'data: {"text": "ab\\n\\n"}\n\n',  # escaped newlines are not frame ends
    b"data: [DONE]\n\n",
]
EXPECTED = [  # (raw, event, data) of each frame that is an event
    (FRAMES[0], b"", b'{"text": "a", "output_ids": [1, 2, 3]}'),
    (FRAMES[2], b"weir.preempted", b"{}"),
    (FRAMES[3], b"", b'{"no": "space"}'),
    (FRAMES[4], b"", b" two spaces"),
    (FRAMES[5], b"", b"line one\nline two"),
    (FRAMES[6], b"", b'{"text": "ab\\n\\n"}'),
    (FRAMES[7], b"", b"[DONE]"),
]


@given(st.lists(st.integers(min_value=1, max_value=len(b"".join(FRAMES)) - 1), max_size=16))
def test_events_are_the_same_however_the_stream_is_cut(cuts: list[int]) -> None:
    stream = b"".join(FRAMES)
    bounds = [0, *sorted(set(cuts)), len(stream)]
    framer = SSEFramer()
    seen = []
    for start, end in itertools.pairwise(bounds):
        seen.extend(framer.feed(stream[start:end]))
    assert [(e.raw, e.event, e.data) for e in seen] == EXPECTED
    assert [e.done for e in seen] == [False] * 6 + [True]


def test_a_partial_frame_waits_for_its_end() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: x\n") == []
    assert framer.feed(b"data: y") == []
    (event,) = framer.feed(b"\n\ndata: z\n")
    assert event.data == b"x\ny"
    assert [e.data for e in framer.feed(b"\n")] == [b"z"]
