"""The p2p tier's control messages: a strict msgspec tagged union, encoded with MessagePack.

The message set is vLLM's p2p tier's: every message is a map whose ``"type"`` field is one
of ``connect``, ``connect_ack``, ``disconnect``, ``lookup``, ``lookup_resp``, ``fetch``,
``transfer_done``, ``abort_fetch``, ``abort_ack``. kvtier moves the bulk bytes over UCX, not
NIXL, so the handshake carries no NIXL agent metadata or base address; it carries the UCX
listener's port and a per-session token instead (:class:`ConnectAck`).

Semantics callers rely on:

* **One exception, whatever the bytes.** :func:`decode` returns a :data:`Message` or raises
  :class:`ProtocolError` with a short ``reason`` label (one of :data:`REJECT_REASONS`); it raises
  nothing else for any input. Nothing received is unpickled or evaluated: msgspec decodes
  straight into the frozen Structs below.
* **Bounded before decoding.** A frame longer than :data:`MAX_FRAME_BYTES` is refused unread
  (``"oversized"``). Every list is bounded by :data:`MAX_KEYS_PER_MESSAGE`, every string and key
  by a length, every integer by a sign (msgspec ``Meta`` constraints, checked while decoding).
* **Strict schema.** Unknown types (``"unknown_type"``), unknown fields (``"unknown_field"``),
  missing fields and wrong types or bounds (``"bad_field"``) are refused; so are parallel lists of
  unequal length (``"length_mismatch"``), checked after msgspec decoding.
* **Constructing is not validating.** Structs built in Python are not bound-checked (msgspec
  checks ``Meta`` only when decoding); :func:`encode` checks the frame size and the parallel
  lengths, so the local side never sends a frame its peer is certain to refuse for those.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Union

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_KEYS_PER_MESSAGE",
    "MAX_KEY_BYTES",
    "MAX_PEER_ID_CHARS",
    "MIN_KEY_BYTES",
    "REJECT_REASONS",
    "TOKEN_BYTES",
    "AbortAck",
    "AbortFetch",
    "Connect",
    "ConnectAck",
    "Disconnect",
    "Fetch",
    "Lookup",
    "LookupResp",
    "Message",
    "ProtocolError",
    "TransferDone",
    "decode",
    "encode",
    "parse_peer_id",
]

MAX_KEYS_PER_MESSAGE: Final = 4096
"""Longest ``keys`` / ``hits`` / ``block_indexes`` list in one message (a request's chunks per round)."""

MIN_KEY_BYTES: Final = 5
MAX_KEY_BYTES: Final = 68
"""An offload key is a 1..64-byte block hash followed by the 4-byte big-endian group index."""

MAX_FRAME_BYTES: Final = 1 << 20
"""Largest payload frame accepted (1 MiB), checked before decoding.

The largest valid message is a :class:`Fetch` of 4096 keys: 4096 × (68 + 2 bytes of bin8 header)
= 280 KiB of keys, plus 4096 × 9 bytes of uint64 slot ids = 36 KiB, plus a 1 KiB request id and
field names: about 320 KiB (a full :class:`LookupResp` is about 285 KiB). 1 MiB leaves 3× headroom
for future fields while bounding what a peer can make the decoder read.
"""

MAX_PEER_ID_CHARS: Final = 255
"""Longest ``"host:port"`` identity: ZeroMQ routing ids are 1..255 bytes (``ZMQ_ROUTING_ID``)."""

TOKEN_BYTES: Final = 32
"""Length of the per-session data-plane token carried by :class:`ConnectAck`."""

MAX_REQUEST_ID_CHARS: Final = 1024
MAX_FINGERPRINT_CHARS: Final = 64
MAX_HASH_SEED_CHARS: Final = 256
MAX_REASON_CHARS: Final = 200

REJECT_REASONS: Final = frozenset(
    {"oversized", "malformed", "unknown_type", "unknown_field", "bad_field", "length_mismatch"}
)
"""Every :attr:`ProtocolError.reason` :func:`decode` can raise (metrics label values)."""

# A hostname / IPv4 literal, or a bracketed IPv6 literal, then ":" and a canonical port 1..65535
# (no sign, no leading zero), so that one peer has exactly one spelling.
_PORT_RE = r"(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_HOST_RE = r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]{2,45}\])"
PEER_ID_PATTERN: Final = rf"^{_HOST_RE}:{_PORT_RE}\Z"
_PEER_ID_RE: Final = re.compile(PEER_ID_PATTERN)


def parse_peer_id(peer_id: str) -> tuple[str, int]:
    """Split a ``"host:port"`` peer identity into ``(host, port)``.

    ``host`` is a hostname, an IPv4 literal or a bracketed IPv6 literal (``"[::1]:5710"``);
    ``port`` is 1..65535 written canonically. Raises :class:`ValueError` otherwise (the message
    quotes at most the first 64 characters of the offending id).
    """
    if len(peer_id) > MAX_PEER_ID_CHARS or _PEER_ID_RE.match(peer_id) is None:
        raise ValueError(f"peer id {peer_id[:64]!r} is not 'host:port' (at most {MAX_PEER_ID_CHARS} chars)")
    host, _, port = peer_id.rpartition(":")
    return host, int(port)


PeerId = Annotated[str, Meta(min_length=1, max_length=MAX_PEER_ID_CHARS, pattern=PEER_ID_PATTERN)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
RoundSeq = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
OffloadKey = Annotated[bytes, Meta(min_length=MIN_KEY_BYTES, max_length=MAX_KEY_BYTES)]
KeyList = Annotated[list[OffloadKey], Meta(max_length=MAX_KEYS_PER_MESSAGE)]
HitList = Annotated[list[bool], Meta(max_length=MAX_KEYS_PER_MESSAGE)]
SlotList = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_KEYS_PER_MESSAGE)]
Fingerprint = Annotated[str, Meta(max_length=MAX_FINGERPRINT_CHARS)]
HashSeed = Annotated[str, Meta(max_length=MAX_HASH_SEED_CHARS)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Token = Annotated[bytes, Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every control message (not itself a message); subclasses inherit the options but
    ``kw_only`` applies per class, so optional fields come last."""


class Connect(_Msg, tag="connect", frozen=True):
    """First message on a session, in both directions: who I am and what my run looks like.

    The receiver refuses the session unless ``block_len`` equals its slot size, the fingerprints
    match when both are non-empty, and ``hash_seed`` equals its NONE_HASH seed.
    No NIXL ``agent_metadata`` / ``base_addr``: kvtier's data plane is UCX, whose listener port and
    token travel in :class:`ConnectAck`.
    """

    peer_id: PeerId
    block_len: PositiveInt
    num_blocks: PositiveInt
    hash_seed: HashSeed
    config_fingerprint: Fingerprint = ""


class ConnectAck(_Msg, tag="connect_ack", frozen=True):
    """Reply to :class:`Connect`: the acceptor's identity fields (so the initiator checks them too),
    its UCX listener port and the per-session data-plane token the initiator's UCX endpoint must
    present first."""

    peer_id: PeerId
    block_len: PositiveInt
    num_blocks: PositiveInt
    hash_seed: HashSeed
    data_port: Port
    token: Token
    config_fingerprint: Fingerprint = ""


class Disconnect(_Msg, tag="disconnect", frozen=True):
    """Either side ends the session; ``reason`` is a short label for logs."""

    reason: Annotated[str, Meta(max_length=MAX_REASON_CHARS)] = ""


class Lookup(_Msg, tag="lookup", frozen=True):
    """Consumer → producer: which of these keys do you hold (symmetric P2P probing)?"""

    kv_request_id: RequestId
    keys: KeyList
    round_seq: RoundSeq


class LookupResp(_Msg, tag="lookup_resp", frozen=True):
    """Producer → consumer: ``hits[i]`` answers ``keys[i]``; pairs are self-describing."""

    kv_request_id: RequestId
    keys: KeyList
    hits: HitList


class Fetch(_Msg, tag="fetch", frozen=True):
    """Consumer → producer: write ``keys[i]`` into the consumer's host slot ``block_indexes[i]``.

    Both lists empty is the terminal "request finished" fetch: the producer releases its pins.
    """

    kv_request_id: RequestId
    keys: KeyList
    block_indexes: SlotList
    round_seq: RoundSeq


class TransferDone(_Msg, tag="transfer_done", frozen=True):
    """Producer → consumer: round ``round_seq`` of the request's fetch finished (or failed)."""

    kv_request_id: RequestId
    success: bool
    round_seq: RoundSeq


class AbortFetch(_Msg, tag="abort_fetch", frozen=True):
    """Consumer → producer: give up round ``round_seq``; answered by :class:`AbortAck`."""

    kv_request_id: RequestId
    round_seq: RoundSeq


class AbortAck(_Msg, tag="abort_ack", frozen=True):
    """Producer → consumer: no transfer of round ``round_seq`` is running any more."""

    kv_request_id: RequestId
    round_seq: RoundSeq


Message = Union[Connect, ConnectAck, Disconnect, Lookup, LookupResp, Fetch, TransferDone, AbortFetch, AbortAck]
"""Any control message."""


class ProtocolError(Exception):
    """A frame is not a valid control message; ``reason`` is a label from :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)


def _length_mismatch(msg: Message) -> str | None:
    if isinstance(msg, LookupResp) and len(msg.keys) != len(msg.hits):
        return f"{len(msg.keys)} keys but {len(msg.hits)} hits"
    if isinstance(msg, Fetch) and len(msg.keys) != len(msg.block_indexes):
        return f"{len(msg.keys)} keys but {len(msg.block_indexes)} block_indexes"
    return None


def _classify(error: msgspec.ValidationError) -> str:
    # msgspec reports schema failures as one exception type; its message says where. The
    # protocol tests pin each wording to its reason, so a msgspec change cannot go unnoticed.
    text = str(error)
    if "unknown field" in text:
        return "unknown_field"
    if "`$.type`" in text or "required field `type`" in text:
        return "unknown_type"
    if "missing required field" in text:
        return "bad_field"
    if " - at " not in text or "`key` in `$`" in text:
        return "malformed"  # not a map with string keys at the top level
    return "bad_field"


def encode(msg: Message) -> bytes:
    """Serialise ``msg`` to one frame.

    Raises :class:`ProtocolError` (``"length_mismatch"`` or ``"oversized"``) for a message its
    peer would refuse for those reasons: a local bug, never a peer's doing.
    """
    mismatch = _length_mismatch(msg)
    if mismatch is not None:
        raise ProtocolError("length_mismatch", mismatch)
    frame = _ENCODER.encode(msg)
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("oversized", f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one frame into a :data:`Message`; raises only :class:`ProtocolError`."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("oversized", f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        msg = _DECODER.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_classify(exc), str(exc)[:200]) from None
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as exc:
        raise ProtocolError("malformed", str(exc)[:200]) from None
    mismatch = _length_mismatch(msg)
    if mismatch is not None:
        raise ProtocolError("length_mismatch", mismatch)
    return msg
