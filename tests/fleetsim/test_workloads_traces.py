"""Trace replay: Mooncake JSONL and Azure CSV, with bad lines named, not skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetsim.workloads import BLOCK_TOKENS, TraceError, read_trace, scenario, write_trace


def _mooncake(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_replay_keeps_prefix_reuse_and_rebases_time(tmp_path: Path) -> None:
    path = _mooncake(
        tmp_path,
        [
            {"timestamp": 5000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]},
            {"timestamp": 3000, "input_length": 700, "output_length": 2000, "hash_ids": [1, 4]},
            {"timestamp": 7000, "input_length": 9000, "output_length": 5, "hash_ids": [1]},
        ],
    )
    specs = read_trace(path, speedup=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.0]
    assert specs[0].block_ids == (1, 4)
    assert specs[1].block_ids == (1, 2, 3)
    assert specs[0].is_long
    assert specs[2].is_long
    assert not specs[1].is_long
    # A trace that names fewer blocks than the prompt needs gets unique tail blocks.
    assert specs[2].block_ids[0] == 1
    assert len(specs[2].block_ids) == -(-9000 // BLOCK_TOKENS)
    assert len(set(specs[2].block_ids[1:]) & set(specs[0].block_ids)) == 0
    assert read_trace(path, limit=2) == read_trace(path)[:2]


def test_azure_csv_replay(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0000000,1200,0\n"
    )
    specs = read_trace(path)
    assert [s.input_tokens for s in specs] == [374, 396, 1200]
    assert specs[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert specs[2].output_tokens == 1
    blocks = [b for s in specs for b in s.block_ids]
    assert len(blocks) == len(set(blocks)), "Azure prompts share nothing"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "negative"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1}', "positive integer"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1.5}', "positive integer"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1}', "finite number"),
    ],
)
def test_bad_mooncake_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as caught:
        read_trace(path)
    assert f"{path}:2" in str(caught.value) or "bad.jsonl:2" in str(caught.value)


def test_bad_azure_and_empty_traces(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="missing"):
        read_trace(wrong)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,4\n")
    with pytest.raises(TraceError, match=r"bad\.csv:2"):
        read_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)
    with pytest.raises(ValueError, match="speedup"):
        read_trace(wrong, speedup=0)


def test_a_written_trace_replays_a_scenarios_lengths_prefixes_and_arrivals(
    tmp_path: Path,
) -> None:
    """`write_trace` writes what a Mooncake trace can say of a scenario's requests:
    replayed, every request keeps its lengths and its prompt's block ids (its shared
    prefixes), and arrivals keep their spacing (rebased to the first, to the ms)."""
    specs = scenario("few_long_many_short").with_duration(20.0).generate(5.0, seed=3)
    path = tmp_path / "written.jsonl"
    assert write_trace(specs, path) == len(specs)
    replayed = read_trace(path)
    assert [(r.input_tokens, r.output_tokens, r.max_tokens, r.block_ids) for r in replayed] == [
        (s.input_tokens, s.generated_tokens, s.generated_tokens, s.block_ids) for s in specs
    ]
    start = specs[0].arrival_s
    for r, s in zip(replayed, specs, strict=True):
        assert r.arrival_s == pytest.approx(s.arrival_s - start, abs=2e-6)
