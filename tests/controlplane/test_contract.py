"""The contract's codec: round trips, strict decoding, schema versions, policy validation."""

from __future__ import annotations

import msgspec
import pytest

from controlplane.contract import (
    SCHEMA_VERSION,
    Command,
    CommandKind,
    Continuation,
    EndpointState,
    FinishReason,
    KVPolicy,
    PoolPolicy,
    Role,
    SchemaError,
    WatermarkState,
    decode,
    decode_json,
    encode,
    encode_json,
)


def _endpoint(**overrides: object) -> EndpointState:
    fields: dict[str, object] = {
        "pool": "chat",
        "endpoint_id": "chat-0",
        "address": "127.0.0.1:30000",
        "model": "llama-8b",
        "epoch": 3,
        "version": 17,
        "kv_capacity_tokens": 1000,
        "kv_used_tokens": 600,
        "kv_reserved_growth_tokens": 150,
    }
    fields.update(overrides)
    return EndpointState(**fields)  # type: ignore[arg-type]


def test_endpoint_round_trips_through_msgpack_and_json() -> None:
    state = _endpoint(watermark=WatermarkState.PRESSURE, adapters=("sql-lora",))
    assert decode(encode(state), EndpointState) == state
    assert decode_json(encode_json(state), EndpointState) == state
    assert decode_json(encode_json(state).decode(), EndpointState) == state


def test_derived_kv_figures() -> None:
    state = _endpoint()
    assert state.kv_free_tokens == 250
    assert state.kv_pressure == pytest.approx(0.75)
    assert _endpoint(kv_capacity_tokens=0).kv_pressure == 1.0


def test_unknown_schema_version_is_refused() -> None:
    data = encode(_endpoint(schema=SCHEMA_VERSION + 1))
    with pytest.raises(SchemaError, match="schema version"):
        decode(data, EndpointState)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1\xff",
        msgspec.msgpack.encode({"pool": "chat"}),
        msgspec.msgpack.encode({"pool": "chat", "endpoint_id": 7, "address": "a", "model": "m"}),
    ],
)
def test_malformed_records_are_refused(payload: bytes) -> None:
    with pytest.raises(SchemaError, match="malformed EndpointState"):
        decode(payload, EndpointState)


def test_a_record_nested_too_deeply_is_malformed_not_a_crash() -> None:
    deep = b'{"request_id": "r", "model": "m", "api": "generate", "body": {"x": '
    deep += b"[" * 1000 + b"]" * 1000 + b'}, "max_new_tokens": 4}'
    with pytest.raises(SchemaError, match="nested too deeply"):
        decode_json(deep, Continuation)


def test_commands_reject_unknown_kinds() -> None:
    raw = msgspec.json.encode(
        {"command_id": "c1", "pool": "p", "endpoint_id": "e", "kind": "reboot"}
    )
    with pytest.raises(SchemaError):
        decode_json(raw, Command)
    ok = Command(command_id="c1", pool="p", endpoint_id="e", kind=CommandKind.DRAIN)
    assert decode_json(encode_json(ok), Command) == ok


def test_watermark_states_are_ordered() -> None:
    ranks = [s.rank for s in WatermarkState]
    assert ranks == sorted(ranks) == [0, 1, 2, 3]


def test_only_preempted_is_not_final() -> None:
    assert [r for r in FinishReason if not r.is_final] == [FinishReason.PREEMPTED]


def test_pool_policy_validates_watermark_order_and_prefill_pools() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        PoolPolicy(pool="p", model="m", kv=KVPolicy(low_watermark=0.9, high_watermark=0.8))
    with pytest.raises(ValueError, match="decode pool"):
        PoolPolicy(pool="p", model="m", role=Role.PREFILL)
    raw = b'{"pool":"p","model":"m","kv":{"low_watermark":0.9,"high_watermark":0.8}}'
    with pytest.raises(SchemaError, match="watermarks"):
        decode_json(raw, PoolPolicy)
    policy = decode_json(b'{"pool":"p","model":"m"}', PoolPolicy)
    assert policy.kv.high_watermark == 0.85
    assert policy.scheduling.target_tpot_s == 0.0  # no TPOT gate unless declared
    for bad in (b"-0.01", b"1e999"):
        raw = b'{"pool":"p","model":"m","scheduling":{"target_tpot_s":' + bad + b"}}"
        with pytest.raises(SchemaError, match="target_tpot_s"):
            decode_json(raw, PoolPolicy)
