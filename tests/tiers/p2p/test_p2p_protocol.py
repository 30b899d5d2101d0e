"""The p2p control messages (kvtier/tiers/p2p/protocol.py): round trips and every bound."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.p2p.protocol import (
    MAX_FRAME_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_MESSAGE,
    MIN_KEY_BYTES,
    REJECT_REASONS,
    AbortAck,
    AbortFetch,
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Lookup,
    LookupResp,
    Message,
    ProtocolError,
    TransferDone,
    decode,
    encode,
    parse_peer_id,
)

KEY = b"\x01" * 32 + (0).to_bytes(4, "big")
TOKEN = bytes(range(32))

EVERY_MESSAGE: list[Message] = [
    Connect(peer_id="127.0.0.1:5710", block_len=4096, num_blocks=10, config_fingerprint="ab12", hash_seed="s"),
    Connect(peer_id="node-1.example:5711", block_len=1, num_blocks=1, hash_seed=""),
    ConnectAck(
        peer_id="[::1]:5710", block_len=4096, num_blocks=10, config_fingerprint="", hash_seed="seed",
        data_port=6000, token=TOKEN,
    ),
    Disconnect(),
    Disconnect(reason="shutdown"),
    Lookup(kv_request_id="req-1", keys=[KEY, KEY[:5]], round_seq=0),
    LookupResp(kv_request_id="req-1", keys=[KEY], hits=[True]),
    Fetch(kv_request_id="req-1", keys=[KEY], block_indexes=[7], round_seq=3),
    Fetch(kv_request_id="req-1", keys=[], block_indexes=[], round_seq=4),  # terminal fetch
    TransferDone(kv_request_id="req-1", success=False, round_seq=3),
    AbortFetch(kv_request_id="req-1", round_seq=3),
    AbortAck(kv_request_id="req-1", round_seq=3),
]


def raw(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def reason_of(frame: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.reason in REJECT_REASONS
    return info.value.reason


def fetch(**override: Any) -> bytes:
    fields: dict[str, Any] = {"type": "fetch", "kv_request_id": "r", "keys": [KEY], "block_indexes": [0], "round_seq": 0}
    fields.update(override)
    return raw(fields)


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def test_tags_are_the_reference_type_names() -> None:
    tags = {msgspec.msgpack.decode(encode(m))["type"] for m in EVERY_MESSAGE}
    assert tags == {
        "connect", "connect_ack", "disconnect", "lookup", "lookup_resp", "fetch", "transfer_done",
        "abort_fetch", "abort_ack",
    }


def test_a_full_fetch_fits_the_frame_bound() -> None:
    biggest = Fetch(
        kv_request_id="r" * 1024, keys=[b"k" * MAX_KEY_BYTES] * MAX_KEYS_PER_MESSAGE,
        block_indexes=[2**63] * MAX_KEYS_PER_MESSAGE, round_seq=2**63,
    )
    assert len(encode(biggest)) < MAX_FRAME_BYTES // 2
    assert decode(encode(biggest)) == biggest


def test_oversized_frame_is_refused_before_decoding() -> None:
    assert reason_of(b"\x00" * (MAX_FRAME_BYTES + 1)) == "oversized"


def test_too_many_keys_is_a_bad_field() -> None:
    n = MAX_KEYS_PER_MESSAGE + 1
    assert reason_of(fetch(keys=[KEY] * n, block_indexes=[0] * n)) == "bad_field"
    assert reason_of(raw({"type": "lookup", "kv_request_id": "r", "keys": [KEY] * n, "round_seq": 0})) == "bad_field"


@pytest.mark.parametrize("key", [b"", b"x" * (MIN_KEY_BYTES - 1), b"x" * (MAX_KEY_BYTES + 1)])
def test_keys_of_wrong_length_are_bad_fields(key: bytes) -> None:
    assert reason_of(fetch(keys=[key])) == "bad_field"


@pytest.mark.parametrize(
    "override",
    [
        {"round_seq": "1"},
        {"round_seq": -1},
        {"block_indexes": [-1]},
        {"keys": ["not-bytes-but-a-str"]},
        {"kv_request_id": ""},
        {"kv_request_id": "r" * 1025},
        {"kv_request_id": 5},
        {"round_seq": 1.5},
    ],
)
def test_wrong_types_and_bounds_are_bad_fields(override: dict[str, Any]) -> None:
    assert reason_of(fetch(**override)) == "bad_field"


def test_missing_field_is_a_bad_field() -> None:
    assert reason_of(raw({"type": "abort_ack", "kv_request_id": "r"})) == "bad_field"


@pytest.mark.parametrize(
    "fields",
    [
        {"block_len": 0},
        {"num_blocks": -1},
        {"peer_id": "no-port"},
        {"peer_id": "host:0"},
        {"peer_id": "host:65536"},
        {"peer_id": "host:05710"},
        {"peer_id": "h" * 251 + ":5710"},
        {"config_fingerprint": "f" * 65},
        {"hash_seed": "s" * 257},
    ],
)
def test_connect_fields_are_bounded(fields: dict[str, Any]) -> None:
    good = {"type": "connect", "peer_id": "127.0.0.1:5710", "block_len": 1, "num_blocks": 1, "hash_seed": "s"}
    decode(raw(good))
    assert reason_of(raw({**good, **fields})) == "bad_field"


@pytest.mark.parametrize("token", [b"", TOKEN[:31], TOKEN + b"x", "a" * 32])
def test_connect_ack_token_is_exactly_32_bytes(token: Any) -> None:
    fields = {
        "type": "connect_ack", "peer_id": "127.0.0.1:5710", "block_len": 1, "num_blocks": 1,
        "hash_seed": "s", "data_port": 6000, "token": token,
    }
    assert reason_of(raw(fields)) == "bad_field"
    assert reason_of(raw({**fields, "token": TOKEN, "data_port": 0})) == "bad_field"


def test_unknown_field_is_refused() -> None:
    assert reason_of(fetch(agent_metadata=b"nixl")) == "unknown_field"


@pytest.mark.parametrize("frame", [raw({"type": "pickle"}), raw({"type": 1}), raw({"keys": []}), raw({"type": None})])
def test_unknown_or_missing_type_is_refused(frame: bytes) -> None:
    assert reason_of(frame) == "unknown_type"


@pytest.mark.parametrize("frame", [b"", b"\xc1", raw([1, 2]), raw("connect"), raw({1: 2}), b"\x91" * 100_000])
def test_non_messages_are_malformed(frame: bytes) -> None:
    assert reason_of(frame) == "malformed"


def test_unequal_parallel_lists_are_refused() -> None:
    assert reason_of(fetch(keys=[KEY, KEY], block_indexes=[0])) == "length_mismatch"
    assert reason_of(fetch(keys=[], block_indexes=[1])) == "length_mismatch"
    resp = {"type": "lookup_resp", "kv_request_id": "r", "keys": [KEY], "hits": []}
    assert reason_of(raw(resp)) == "length_mismatch"


def test_encode_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(ProtocolError) as info:
        encode(LookupResp(kv_request_id="r", keys=[KEY], hits=[]))
    assert info.value.reason == "length_mismatch"
    with pytest.raises(ProtocolError) as info:
        encode(Disconnect(reason="x" * (MAX_FRAME_BYTES + 1)))
    assert info.value.reason == "oversized"


def test_peer_ids_are_canonical_host_port() -> None:
    assert parse_peer_id("127.0.0.1:5710") == ("127.0.0.1", 5710)
    assert parse_peer_id("[::1]:1") == ("[::1]", 1)
    for bad in ["127.0.0.1", ":5710", "*:5710", "h:0", "h:+1", "h:1 ", "a b:1", "\x00ab:1", "h" * 260 + ":1"]:
        with pytest.raises(ValueError):
            parse_peer_id(bad)


def _never_raises_other_than_protocol_error(frame: bytes) -> None:
    try:
        decode(frame)
    except ProtocolError as exc:
        assert exc.reason in REJECT_REASONS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_protocol_error(frame: bytes) -> None:
    _never_raises_other_than_protocol_error(frame)


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.binary(max_size=80), st.text(max_size=40),
    st.sampled_from(["connect", "connect_ack", "lookup", "lookup_resp", "fetch", "transfer_done", "abort_fetch",
                     "abort_ack", "disconnect"]),
)
_values = st.recursive(
    _leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)
_field_names = st.sampled_from(
    ["type", "peer_id", "block_len", "num_blocks", "config_fingerprint", "hash_seed", "data_port", "token",
     "reason", "kv_request_id", "keys", "hits", "block_indexes", "round_seq", "success", "other"]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_field_names, _values, max_size=8) | st.lists(_values, max_size=4))
def test_arbitrary_msgpack_documents_only_raise_protocol_error(document: Any) -> None:
    _never_raises_other_than_protocol_error(raw(document))
