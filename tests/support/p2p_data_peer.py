"""The producer side of ``tests/tiers/p2p/test_p2p_data.py``, run as a child process.

It starts a :class:`~kvtier.tiers.p2p.data.DataPlane` and answers one command per stdin line, each
in a task of its own (so a ``send`` waiting for its link does not block the next command); every
answer is one stdout line starting with the command's name:

    (at start)                          -> port <data port>
    token <session>                     -> token <session> <hex>
    revoke <session>                    -> revoked <session>
    send <session> <count> <bytes> <round> <first> [<last>]
                                        -> sent <session>      chunks first..last-1 (default: all),
                                           sent concurrently from one page-aligned buffer, in
                                           reverse order; chunk i holds chunk_bytes(round, i, bytes)
    stats                               -> stats <endpoints_accepted> <endpoints_refused>
    quit                                -> (closes the plane, exits 0)

Usage: ``python tests/support/p2p_data_peer.py [accept_timeout_s]``.
"""

from __future__ import annotations

import asyncio
import mmap
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from kvtier.tiers.p2p.data import DataPlane, chunk_tag  # noqa: E402


def chunk_bytes(round_seq: int, index: int, nbytes: int) -> np.ndarray:
    """The content of chunk ``index`` of round ``round_seq`` (both processes compute it)."""
    return np.random.default_rng([round_seq, index]).integers(0, 256, nbytes, dtype=np.uint8)


def say(line: str) -> None:
    print(line, flush=True)


async def send(plane: DataPlane, session: str, count: int, nbytes: int, round_seq: int, first: int,
               last: int) -> None:
    slots = memoryview(mmap.mmap(-1, count * nbytes))
    for i in range(count):
        np.frombuffer(slots[i * nbytes:(i + 1) * nbytes], dtype=np.uint8)[:] = chunk_bytes(round_seq, i, nbytes)
    link = await plane.accepted(session, timeout=30)
    await asyncio.gather(*(link.send(slots[i * nbytes:(i + 1) * nbytes], chunk_tag(session, round_seq, i))
                           for i in reversed(range(first, last))))
    say(f"sent {session}")


async def main() -> None:
    plane = DataPlane(accept_timeout_s=float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
    say(f"port {await plane.start()}")
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "token":
            say(f"token {words[1]} {plane.issue_token(words[1]).hex()}")
        elif words[0] == "revoke":
            plane.revoke(words[1])
            say(f"revoked {words[1]}")
        elif words[0] == "stats":
            stats = plane.statistics()
            say(f"stats {stats.endpoints_accepted} {stats.endpoints_refused}")
        elif words[0] == "send":
            session, count, nbytes, round_seq, first = words[1], *map(int, words[2:6])
            last = int(words[6]) if len(words) > 6 else count
            task = asyncio.ensure_future(send(plane, session, count, nbytes, round_seq, first, last))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await plane.aclose()


if __name__ == "__main__":
    asyncio.run(main())
