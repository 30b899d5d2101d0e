"""``kvtier warm``: ask an engine's warm-up endpoint to prefetch a prompt's cached prefix.

:func:`warm` is the blocking client a router (or a script) calls; ``kvtier warm ENDPOINT
--tokens-file F.json`` drives it from the command line and prints the reply as one JSON line.
The wire format is :mod:`kvtier.engine.warm_protocol`'s (``docs/embedding.md``, "Warm-up
endpoint").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import msgspec
import zmq

from kvtier.config.curve import load_certificate
from kvtier.engine.warm_protocol import ERROR_CODES, Error, build_request, decode_reply, encode
from kvtier.errors import KvtierError
from kvtier.ops.cli_args import CliParser, exit_codes_epilog

__all__ = ["WarmupError", "warm", "run_warm_cli", "DEFAULT_TIMEOUT_S"]

#: Default of :func:`warm`'s ``timeout_s`` and ``kvtier warm --timeout``.
DEFAULT_TIMEOUT_S = 30.0
_MAX_REPLY_BYTES = 1 << 20
_MAX_TOKENS_FILE_BYTES = 256 << 20
_ENDPOINT_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9_.-]{1,253}):([0-9]{1,5})\Z")
_ids = itertools.count(1)


class WarmupError(KvtierError):
    """A warm-up request that did not succeed.

    ``code`` is the server's error code (one of ``bad_request``, ``too_large``, ``busy``,
    ``closed``, ``internal``; ``reply`` is then the error reply as a dict), or ``"no_reply"``
    when no reply came within ``timeout_s`` (``reply`` is ``None``): the endpoint is down or
    unreachable, it refused this client's CURVE key (or its lack of one), or the request was larger
    than twice the server's ``max_request_bytes``.
    """

    def __init__(self, code: str, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(f"warm-up {code}: {message}")
        self.code = code
        self.reply = reply


def warm(endpoint: str, token_ids: Sequence[int], *, cache_salt: str | None = None,
         lora_name: str | None = None, lora_path: str | None = None,
         mm_items: Sequence[tuple[str, int, int]] | None = None, tiers: Sequence[Any] | None = None,
         max_load_tokens: int | None = None, deadline_s: float | None = None, evict: bool = True,
         timeout_s: float = DEFAULT_TIMEOUT_S, curve_secret_key_file: str | None = None,
         curve_server_key_file: str | None = None) -> dict[str, Any]:
    """Send one prefetch request to the warm-up endpoint at ``endpoint`` and wait for its reply.

    ``endpoint`` is ``tcp://HOST:PORT`` (``HOST:PORT`` is taken too). The other arguments are the
    request's fields (:class:`~kvtier.engine.warm_protocol.Prefetch`); ``tiers`` holds
    ``kv_load_tiers`` entries (tier indexes, type names or labels, ``{medium, locality}`` dicts).
    With CurveZMQ, ``curve_secret_key_file`` is this client's ``.key_secret`` certificate (its
    public key must be in the server's ``curve_allowed_clients_dir``) and
    ``curve_server_key_file`` the server's public certificate.

    Returns the outcome reply as a dict: ``type`` (``"outcome"``), ``id``, ``tokens``,
    ``chunks_by_tier``, ``pending``, ``timed_out``, ``seconds``. Raises :class:`WarmupError` for
    an error reply or no reply within ``timeout_s``; ``ValueError``/``TypeError`` for arguments the
    server would refuse as malformed, an endpoint that is not ``tcp://HOST:PORT``, or unusable key
    files (nothing is sent then).
    """
    address = _address(endpoint)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    fields: dict[str, Any] = {"id": next(_ids), "token_ids": list(token_ids), "evict": evict}
    optional = {"cache_salt": cache_salt, "lora_name": lora_name, "lora_path": lora_path,
                "mm_items": None if mm_items is None else [list(item) for item in mm_items],
                "tiers": None if tiers is None else list(tiers), "max_load_tokens": max_load_tokens,
                "deadline_s": deadline_s}
    fields.update({key: value for key, value in optional.items() if value is not None})
    request = build_request(fields)
    keys = _client_keys(curve_secret_key_file, curve_server_key_file)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
        if address.startswith("tcp://["):
            dealer.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = keys
        try:
            dealer.connect(address)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect to {address!r}: {exc.strerror}") from None
        dealer.send(encode(request))
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms, zmq.POLLIN):
                raise WarmupError("no_reply", f"no reply from {address} within {timeout_s:g} s (is the endpoint "
                                  "up and reachable, and does it accept this client's CURVE key, or none?)")
            try:
                reply = decode_reply(dealer.recv(zmq.NOBLOCK))
            except ValueError:
                continue  # not a reply to us: keep waiting for ours
            if reply.id not in (request.id, None):
                continue  # a late reply to an earlier request on a reused identity
            as_dict: dict[str, Any] = msgspec.to_builtins(reply)
            if isinstance(reply, Error):
                raise WarmupError(reply.code, reply.message, as_dict)
            return as_dict
    finally:
        ctx.destroy(linger=0)


def _address(endpoint: Any) -> str:
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
    address = endpoint if "://" in endpoint else f"tcp://{endpoint}"
    match = _ENDPOINT_RE.match(address)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"endpoint {endpoint[:80]!r} is not tcp://HOST:PORT (a port in 1..65535)")
    return address


def _client_keys(secret_file: str | None, server_file: str | None) -> tuple[bytes, bytes, bytes] | None:
    """(public, secret, server public) keys, or None without CURVE; ValueError names the file."""
    if secret_file is None and server_file is None:
        return None
    if secret_file is None or server_file is None:
        raise ValueError("CurveZMQ needs both curve_secret_key_file (this client's .key_secret certificate) "
                         "and curve_server_key_file (the server's public certificate)")
    certificate = load_certificate  # a ConfigError is a ValueError naming the file's option
    public, secret = certificate("curve_secret_key_file", secret_file)
    if secret is None:
        raise ValueError(f"curve_secret_key_file: {secret_file!r} holds no secret key (give the .key_secret "
                         "certificate)")
    server, _ = certificate("curve_server_key_file", server_file)
    return public, secret, server


# ------------------------------------------------------------------------------ the CLI verb

_WARM_EXIT_CODES = {
    0: "the engine prefetched: the outcome reply is printed as one JSON line",
    1: "the endpoint answered with an error (printed as one JSON line: code "
       f"{', '.join(ERROR_CODES)}), or gave no reply within --timeout (the reason on stderr)",
    2: "bad arguments: an endpoint that is not tcp://HOST:PORT, a tokens file that is not a JSON "
       "list of token ids, an unreadable key file, ...",
}


def _build_cli_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="kvtier warm",
        description="Ask an engine's warm-up endpoint to prefetch a prompt's cached prefix into host memory; "
        "print the reply as one JSON line.",
        epilog=exit_codes_epilog(_WARM_EXIT_CODES),
    )
    parser.add_argument("endpoint", metavar="ENDPOINT", help="the warm-up endpoint, tcp://HOST:PORT")
    parser.add_argument("--tokens-file", required=True,
                        help="JSON file ('-': stdin) holding the prompt's token ids as a list, or an object "
                        "with 'token_ids' and optionally 'mm_items' ([hash, offset, length] triples)")
    parser.add_argument("--cache-salt-file", default=None,
                        help="file holding the prompt's cache_salt (one trailing newline is dropped); the salt "
                        "never goes on the command line")
    parser.add_argument("--lora-name", default=None, help="the LoRA adapter's name (with --lora-path)")
    parser.add_argument("--lora-path", default=None, help="the LoRA adapter's path (with --lora-name)")
    parser.add_argument("--tier", action="append", default=None, dest="tiers",
                        help="consult only this secondary tier: an index, a type name or a label such as 1:fs "
                        "(repeatable; default: every tier)")
    parser.add_argument("--max-load-tokens", type=int, default=None, help="prefetch at most this many tokens")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds the engine may spend (default and cap: the server's deadline_s)")
    parser.add_argument("--no-evict", action="store_true", help="promote only into free host slots")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the reply")
    parser.add_argument("--curve-secret-key-file", default=None,
                        help="this client's .key_secret certificate (CurveZMQ; with --curve-server-key-file)")
    parser.add_argument("--curve-server-key-file", default=None, help="the server's public certificate (CurveZMQ)")
    return parser


def run_warm_cli(argv: list[str], *, out: TextIO | None = None) -> int:
    """``kvtier warm``: send one prefetch request and print the reply as one JSON line.

    Exit status: 0 for an outcome, 1 for an error reply (printed too) or no reply within
    ``--timeout`` (one line on stderr), 2 for bad arguments (one line on stderr).
    """
    out = sys.stdout if out is None else out
    try:
        args = _build_cli_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    try:
        token_ids, mm_items = _read_tokens(args.tokens_file)
        cache_salt = None if args.cache_salt_file is None else _read_salt(args.cache_salt_file)
        reply = warm(
            args.endpoint, token_ids, cache_salt=cache_salt, lora_name=args.lora_name, lora_path=args.lora_path,
            mm_items=mm_items, tiers=None if args.tiers is None else [_tier(t) for t in args.tiers],
            max_load_tokens=args.max_load_tokens, deadline_s=args.deadline, evict=not args.no_evict,
            timeout_s=args.timeout, curve_secret_key_file=args.curve_secret_key_file,
            curve_server_key_file=args.curve_server_key_file,
        )
    except (ValueError, TypeError) as exc:
        print(f"kvtier warm: error: {exc}", file=sys.stderr)
        return 2
    except WarmupError as exc:
        if exc.reply is None:
            print(f"kvtier warm: {exc}", file=sys.stderr)
        else:
            out.write(json.dumps(exc.reply) + "\n")
        return 1
    out.write(json.dumps(reply) + "\n")
    return 0


def _read_tokens(path: str) -> tuple[list[Any], list[Any] | None]:
    """Token ids (and mm_items) from a JSON file; ValueError says what is wrong with it."""
    try:
        if path == "-":
            text = sys.stdin.read(_MAX_TOKENS_FILE_BYTES + 1)
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read(_MAX_TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--tokens-file: cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--tokens-file: {path!r} is not UTF-8 JSON") from None
    if len(text) > _MAX_TOKENS_FILE_BYTES:
        raise ValueError(f"--tokens-file: {path!r} is larger than {_MAX_TOKENS_FILE_BYTES >> 20} MiB")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tokens-file: {path!r} is not JSON ({exc.msg}, line {exc.lineno})") from None
    mm_items = None
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"token_ids", "mm_items"})
        if unknown or "token_ids" not in data:
            raise ValueError(f"--tokens-file: {path!r} must hold a list of token ids, or an object with "
                             f"'token_ids' (and optionally 'mm_items'){'; unknown key ' + repr(unknown[0]) if unknown else ''}")
        data, mm_items = data["token_ids"], data.get("mm_items")
    if not isinstance(data, list):
        raise ValueError(f"--tokens-file: {path!r} must hold a JSON list of token ids")
    return data, mm_items


def _read_salt(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            salt = f.read(8192)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--cache-salt-file: cannot read {path!r} ({type(exc).__name__})") from None
    return salt[:-1] if salt.endswith("\n") else salt


def _tier(value: str) -> int | str:
    return int(value) if value.isdigit() else value
