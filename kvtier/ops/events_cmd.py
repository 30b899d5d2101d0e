"""``kvtier events``: subscribe to a kvtier (or vLLM) KV-event publisher and print its batches.

One JSON line per event, byte hashes as hex; with ``--replay-endpoint`` the publisher's buffered
batches come first, then the live ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import msgspec
import zmq

from kvtier.errors import ConfigError
from kvtier.events.endpoints import check_endpoint
from kvtier.events.wire import END_OF_REPLAY_SEQ
from kvtier.ops.cli_args import CliParser, exit_codes_epilog

__all__ = ["run_events_cli", "DEFAULT_CLI_WAIT_S"]

#: Largest message the subscriber takes from a peer, so that no peer can make it buffer without bound.
_MAX_CLI_MESSAGE_BYTES = 256 * 1024 * 1024


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _event_lines(seq: int, payload: bytes) -> list[str]:
    """JSON lines of one batch: ``{"seq", "ts", "data_parallel_rank", "type", <fields>…}``."""
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    ts = batch[0]
    dp_rank = batch[2] if len(batch) > 2 else None
    lines = []
    for event in batch[1]:
        record: dict[str, Any] = {"seq": seq, "ts": ts, "data_parallel_rank": dp_rank}
        if isinstance(event, dict):
            record.update(_jsonable(event))
        else:  # an array_like event from some other publisher: keep it, do not guess names
            record["event"] = _jsonable(event)
        lines.append(json.dumps(record))
    return lines


_EVENTS_EXIT_CODES = {
    0: "--count batches printed; or, without --count, --timeout passed without a batch after at "
       "least one batch; or interrupted (Ctrl-C)",
    1: "timed out: no batch within --wait (or --timeout), or fewer than --count batches before "
       "--timeout; the reason is printed on stderr",
    2: "bad arguments (an endpoint that is not tcp://HOST:PORT, ipc://PATH or inproc://NAME, a "
       "count below 1, ...)",
}
#: Default of ``kvtier events --wait``: how long to wait for the first batch.
DEFAULT_CLI_WAIT_S = 10.0


def _build_cli_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="kvtier events",
        description="Subscribe to a kvtier (or vLLM) KV-event publisher and print one JSON line per "
        "event (byte hashes as hex).",
        epilog=exit_codes_epilog(_EVENTS_EXIT_CODES),
    )
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="publisher PUB endpoint to connect to")
    parser.add_argument("--topic", default="", help="topic to subscribe to (default: all topics)")
    parser.add_argument("--replay-endpoint", default=None,
                        help="publisher ROUTER endpoint: first print the buffered batches from --from-seq "
                        "(default: no replay)")
    parser.add_argument("--from-seq", type=int, default=0, help="first sequence number to replay")
    parser.add_argument("--count", type=int, default=None, help="stop after this many batches (default: no limit)")
    parser.add_argument("--wait", type=float, default=DEFAULT_CLI_WAIT_S,
                        help="give up (exit status 1) when no batch at all arrives within this many seconds; "
                        "0 waits forever")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop after this many seconds without a batch (default: no limit once a batch "
                        "arrived; also replaces --wait for the first batch)")
    return parser


def run_events_cli(argv: list[str], *, out: TextIO | None = None) -> int:
    """``kvtier events``: subscribe and print one JSON line per event (hashes in bytes as hex).

    With ``--replay-endpoint`` the buffered batches from ``--from-seq`` are printed first, then
    live ones (batches already replayed are skipped). Exit status: 0 on ``--count`` batches, on
    ``--timeout`` without ``--count`` once a batch was printed, or on Ctrl-C; 1 (with one line on
    stderr) when no batch arrives within ``--wait`` (default 10 s; ``--timeout`` when given) or
    ``--timeout`` expires before ``--count`` batches; 2 (one line on stderr) on bad arguments.
    """
    out = sys.stdout if out is None else out
    try:
        args = _build_cli_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    problems = []
    if args.count is not None and args.count < 1:
        problems.append(f"--count: {args.count} is invalid; expected an int >= 1")
    if args.from_seq < 0:
        problems.append(f"--from-seq: {args.from_seq} is invalid; expected an int >= 0")
    for name, value in (("--wait", args.wait), ("--timeout", args.timeout)):
        if value is not None and not (value >= 0 and value != float("inf")):
            problems.append(f"--{name.lstrip('-')}: {value} is invalid; expected a number of seconds >= 0")
    for name, endpoint in (("--endpoint", args.endpoint), ("--replay-endpoint", args.replay_endpoint)):
        if endpoint is not None:
            try:
                check_endpoint(name, endpoint)
            except ConfigError as exc:
                problems.append(f"{exc}")
    if problems:
        print(f"kvtier events: error: {problems[0]}", file=sys.stderr)
        return 2
    timeout_ms = None if args.timeout is None else max(int(args.timeout * 1000), 0)
    first_ms: int | None  # the poll timeout for the first batch (None: forever)
    if timeout_ms is not None:
        first_ms = timeout_ms
    else:
        first_ms = None if args.wait == 0 else max(int(args.wait * 1000), 1)
    seen = 0
    last_seq = -1

    def emit(seq: int, payload: bytes) -> None:
        nonlocal seen, last_seq
        try:
            lines = _event_lines(seq, payload)
        except (msgspec.DecodeError, ValueError) as exc:
            print(f"seq {seq}: undecodable batch ({exc})", file=sys.stderr)
            lines = []
        for line in lines:
            out.write(line + "\n")
        out.flush()
        seen += 1
        last_seq = seq

    def done() -> bool:
        return args.count is not None and seen >= args.count

    def timed_out(where: str) -> int:
        if seen == 0:
            waited = args.timeout if args.timeout is not None else args.wait
            print(f"kvtier events: timed out after {waited:g} s waiting for the first batch from {where}; "
                  "is a publisher running there? (--wait 0 waits forever)", file=sys.stderr)
            return 1
        if args.count is None:
            return 0
        print(f"kvtier events: timed out after {args.timeout:g} s without a batch from {where}; "
              f"got {seen} of --count {args.count}", file=sys.stderr)
        return 1

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, _MAX_CLI_MESSAGE_BYTES)  # bound what a peer can make us buffer
    dealer = None
    try:
        sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
        try:
            sub.connect(args.endpoint)
        except zmq.ZMQError as exc:
            print(f"kvtier events: error: --endpoint: cannot connect to {args.endpoint!r}: {exc}", file=sys.stderr)
            return 2
        if args.replay_endpoint:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_CLI_MESSAGE_BYTES)
            try:
                dealer.connect(args.replay_endpoint)
            except zmq.ZMQError as exc:
                print(f"kvtier events: error: --replay-endpoint: cannot connect to {args.replay_endpoint!r}: "
                      f"{exc}", file=sys.stderr)
                return 2
            dealer.send_multipart((b"", args.from_seq.to_bytes(8, "big")))
            while not done():
                if not dealer.poll(first_ms if seen == 0 else timeout_ms):
                    return timed_out(f"replay endpoint {args.replay_endpoint}")
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == END_OF_REPLAY_SEQ:
                    break
                emit(int.from_bytes(frames[2], "big"), frames[3])
        while not done():
            if not sub.poll(first_ms if seen == 0 else timeout_ms):
                return timed_out(args.endpoint)
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq <= last_seq:  # already printed from the replay
                continue
            emit(seq, frames[2])
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()
        if dealer is not None:
            dealer.close()
        ctx.term()
