"""`weir bench router`'s figures for the engine-stream HTTP client: the stream it feeds
is read to its end, decoded and cut through, by this client and by a baseline file."""

from __future__ import annotations

from controlplane.transport import http
from weir.benchmarks._http_reads import http_reads
from weir.benchmarks._report import Report


def test_the_client_and_a_baseline_read_the_benchmark_stream_to_its_end() -> None:
    report = Report("router")
    http_reads(report, runs=1, baseline=http.__file__)  # raises if a stream does not end
    floor, decoded, cut = report.figures
    assert floor.name.startswith("llhttp alone")
    assert decoded.name.endswith("decoded")
    assert cut.name.endswith("cut through")
    for figure in (decoded, cut):
        assert figure.value > 0
        assert f"the client in {http.__file__}" in figure.note
