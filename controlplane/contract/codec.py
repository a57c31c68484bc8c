"""Compact, strict (de)serialization of contract records.

msgpack for Redis (compact), JSON for HTTP, ConfigMaps and humans. A decode that meets an
unknown schema version, a wrong type or a broken byte string raises `SchemaError` naming
the record type and the problem; callers refuse the write and keep what they had.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from controlplane.contract.models import SCHEMA_VERSION

T = TypeVar("T", bound=msgspec.Struct)

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


class SchemaError(ValueError):
    """A record could not be decoded: malformed bytes, wrong types or unknown schema."""


def encode(record: msgspec.Struct) -> bytes:
    return _msgpack_encoder.encode(record)


def encode_json(record: msgspec.Struct) -> bytes:
    return _json_encoder.encode(record)


def decode(data: bytes, record_type: type[T]) -> T:
    decoder = _msgpack_decoders.get(record_type)
    if decoder is None:
        decoder = _msgpack_decoders[record_type] = msgspec.msgpack.Decoder(record_type)
    record: T = _decode_with(decoder, data, record_type)
    return _checked(record, record_type)


def decode_json(data: bytes | str, record_type: type[T]) -> T:
    decoder = _json_decoders.get(record_type)
    if decoder is None:
        decoder = _json_decoders[record_type] = msgspec.json.Decoder(record_type)
    record: T = _decode_with(decoder, data.encode() if isinstance(data, str) else data, record_type)
    return _checked(record, record_type)


def _decode_with(
    decoder: msgspec.msgpack.Decoder[Any] | msgspec.json.Decoder[Any],
    data: bytes,
    record_type: type[Any],
) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SchemaError(f"malformed {record_type.__name__}: {exc}") from exc
    except RecursionError:  # msgspec's guard against a stack overflow
        raise SchemaError(f"malformed {record_type.__name__}: nested too deeply") from None


def _checked(record: T, record_type: type[T]) -> T:
    schema = getattr(record, "schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise SchemaError(
            f"{record_type.__name__} has schema version {schema}; this build understands "
            f"{SCHEMA_VERSION}"
        )
    return record
