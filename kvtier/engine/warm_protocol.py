"""The warm-up endpoint's wire messages: strict msgspec Structs, encoded with MessagePack.

A request is a map whose ``"type"`` is ``"prefetch"`` (:class:`Prefetch`); a reply is a map whose
``"type"`` is ``"outcome"`` (:class:`Outcome`) or ``"error"`` (:class:`Error`). Both carry the
request's ``id`` (an int in ``[0, 2**63)`` or a string of 1..128 characters, chosen by the client);
an error reply to a request whose id could not be read carries ``id: null``.
``docs/embedding.md`` ("Warm-up endpoint") shows the format.

Semantics callers rely on:

* **One exception, whatever the bytes.** :func:`decode_request` returns a :class:`Prefetch` or
  raises :class:`RequestRefused` (``code`` ``"bad_request"`` or ``"too_large"``, a message and the
  request's id when it could be read); nothing else, for any input. Nothing received is unpickled
  or evaluated: msgspec decodes straight into the Structs below.
* **Bounded before decoding.** A payload longer than ``max_bytes`` is refused unread
  (``"too_large"``); every list, string and number has a bound checked while decoding (msgspec
  ``Meta``), and the token count a bound checked after (``max_tokens``, ``"too_large"``).
* **Strict schema.** Unknown types, unknown fields, missing fields, wrong types (a bool or float
  token id, a string where an int belongs) and out-of-range values (a negative id, a
  non-positive or non-finite deadline) are ``"bad_request"``.
* **No secret in a message.** Refusal messages come from the schema (paths and bounds, never a
  field's value) and are cut to :data:`MAX_MESSAGE_CHARS`; :func:`scrubbed` removes a
  ``cache_salt`` from any text that goes back to the client.
* **Constructing is not validating.** Structs built in Python are checked by
  :func:`build_request` (``msgspec.convert``), which clients use before sending.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Union

import msgspec
from msgspec import Meta

__all__ = [
    "ERROR_CODES",
    "MAX_MESSAGE_CHARS",
    "MAX_TOKENS_LIMIT",
    "Error",
    "Outcome",
    "Prefetch",
    "Reply",
    "RequestId",
    "RequestRefused",
    "TierMatch",
    "build_request",
    "decode_reply",
    "decode_request",
    "encode",
    "scrubbed",
]

ERROR_CODES: Final = ("bad_request", "too_large", "busy", "closed", "internal")
"""Every :attr:`Error.code`: a request the server cannot read or accept (``bad_request``), one over
a size bound (``too_large``), one beyond ``max_in_flight`` (``busy``), an engine that is closing
(``closed``), and a failure of the server or engine itself (``internal``)."""

MAX_TOKENS_LIMIT: Final = 1 << 24
"""Most token ids any request may carry, whatever ``max_tokens`` says (a static decoding bound)."""

MAX_MESSAGE_CHARS: Final = 300
"""Longest error message in a reply."""

MAX_ID: Final = 2**63 - 1
_MAX_EXTRA_CHARS: Final = 4096
_MAX_MM_ITEMS: Final = 4096
_MAX_TIER_ENTRIES: Final = 64
# A kv_load_tiers string: a tier type name, optionally as a label "<n>:<type>".
_TIER_NAME_PATTERN: Final = r"^([0-9]{1,4}:)?[A-Za-z_][A-Za-z0-9_.-]{0,255}$"

RequestId = Union[Annotated[int, Meta(ge=0, le=MAX_ID)], Annotated[str, Meta(min_length=1, max_length=128)]]
TokenId = Annotated[int, Meta(ge=0)]  # MessagePack ints end at 2**64 - 1, as token ids do
Extra = Annotated[str, Meta(min_length=1, max_length=_MAX_EXTRA_CHARS)]
MmItem = tuple[Annotated[str, Meta(min_length=1, max_length=256)], Annotated[int, Meta(ge=0)],
               Annotated[int, Meta(ge=1)]]
Count = Annotated[int, Meta(ge=0)]


class TierMatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A ``{medium, locality}`` entry of ``tiers`` (``kv_load_tiers`` matchers)."""

    medium: Annotated[str, Meta(max_length=32)] | None = None
    locality: Annotated[str, Meta(max_length=32)] | None = None


TierEntry = Union[Annotated[int, Meta(ge=0, le=4095)], Annotated[str, Meta(pattern=_TIER_NAME_PATTERN)], TierMatch]


class Prefetch(msgspec.Struct, tag="prefetch", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """Promote the cached prefix of ``token_ids`` into the engine's host memory.

    ``cache_salt``, ``lora_name``/``lora_path`` and ``mm_items`` (``[hash, offset, length]``
    triples) are the extra keys the chunks were stored with; ``tiers`` restricts the secondary
    tiers consulted (``kv_load_tiers`` entries: a tier index, a type name or label, or a
    ``{medium, locality}`` map); ``max_load_tokens`` caps the tokens promoted; ``deadline_s``
    bounds the wait (the server's cap when absent or larger); ``evict: false`` promotes only into
    free host slots.
    """

    id: RequestId
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOKENS_LIMIT)]
    cache_salt: Extra | None = None
    lora_name: Extra | None = None
    lora_path: Extra | None = None
    mm_items: Annotated[list[MmItem], Meta(max_length=_MAX_MM_ITEMS)] | None = None
    tiers: Annotated[list[TierEntry], Meta(max_length=_MAX_TIER_ENTRIES)] | None = None
    max_load_tokens: Count | None = None
    deadline_s: Annotated[float, Meta(gt=0)] | None = None
    evict: bool = True


class Outcome(msgspec.Struct, tag="outcome", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """The engine's answer: ``tokens`` of the prompt now in host memory, ``chunks_by_tier`` (the
    tier label each promoted or already-present chunk came from), ``pending`` chunks still being
    promoted when the deadline passed, ``timed_out``, and the ``seconds`` the prefetch took."""

    id: RequestId
    tokens: Count
    chunks_by_tier: Annotated[dict[Annotated[str, Meta(max_length=256)], Count], Meta(max_length=256)]
    pending: Count
    timed_out: bool
    seconds: Annotated[float, Meta(ge=0)]


class Error(msgspec.Struct, tag="error", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """A refused or failed request: ``code`` is one of :data:`ERROR_CODES`; ``id`` is ``None``
    when the request's id could not be read."""

    id: RequestId | None
    code: str
    message: Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]


Reply = Union[Outcome, Error]


class _IdOnly(msgspec.Struct):
    """Just the id of a request that failed validation (every other field ignored)."""

    id: RequestId | None = None


class RequestRefused(Exception):
    """A request :func:`decode_request` refuses: ``code`` (``bad_request``/``too_large``), a
    message safe to send back, and the request's ``id`` when it could be read."""

    def __init__(self, code: str, message: str, request_id: int | str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message[:MAX_MESSAGE_CHARS]
        self.request_id = request_id


_request_decoder: Final = msgspec.msgpack.Decoder(Prefetch)
_id_decoder: Final = msgspec.msgpack.Decoder(_IdOnly)
_reply_decoder: Final = msgspec.msgpack.Decoder(Reply)
_encoder: Final = msgspec.msgpack.Encoder()


def encode(message: Prefetch | Outcome | Error) -> bytes:
    """``message`` as MessagePack bytes."""
    return _encoder.encode(message)


def decode_request(payload: bytes | memoryview, *, max_bytes: int, max_tokens: int) -> Prefetch:
    """The request in ``payload``, or :class:`RequestRefused` (module docstring)."""
    if len(payload) > max_bytes:
        raise RequestRefused("too_large", f"the request is {len(payload)} bytes; at most {max_bytes} are accepted")
    try:
        request = _request_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise RequestRefused("bad_request", f"invalid request: {exc}", _request_id(payload)) from None
    except msgspec.DecodeError:
        raise RequestRefused("bad_request", "the request is not a MessagePack map") from None
    if request.deadline_s is not None and not math.isfinite(request.deadline_s):
        raise RequestRefused("bad_request", "invalid request: deadline_s must be finite", request.id)
    if len(request.token_ids) > max_tokens:
        raise RequestRefused(
            "too_large", f"the request has {len(request.token_ids)} token ids; at most {max_tokens} are accepted",
            request.id,
        )
    return request


def _request_id(payload: bytes | memoryview) -> int | str | None:
    try:
        return _id_decoder.decode(payload).id
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def build_request(fields: dict[str, Any]) -> Prefetch:
    """A :class:`Prefetch` from plain fields, checked as the server checks a received one.

    Raises ``ValueError`` naming the field for anything the server would refuse as malformed
    (the token count against ``max_tokens`` is the server's to check).
    """
    try:
        request = msgspec.convert({"type": "prefetch", **fields}, Prefetch)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid warm-up request: {exc}") from None
    if request.deadline_s is not None and not math.isfinite(request.deadline_s):
        raise ValueError("invalid warm-up request: deadline_s must be finite")
    return request


def decode_reply(payload: bytes | memoryview) -> Outcome | Error:
    """A server's reply; ``ValueError`` when ``payload`` is not one."""
    try:
        return _reply_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a warm-up reply: {str(exc)[:MAX_MESSAGE_CHARS]}") from None


def scrubbed(text: str, *secrets: str | None) -> str:
    """``text`` without any of ``secrets`` in it (each replaced by ``'***'``), cut to
    :data:`MAX_MESSAGE_CHARS`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text[:MAX_MESSAGE_CHARS]
