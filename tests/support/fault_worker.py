"""Worker processes for ``tests/tiers/test_fault_injection.py`` (a plain script: pytest does not collect it).

Besides the shared helpers (tiny geometry, chunk payloads derived from token ids, exact
load checks) it has one entry point, ``python tests/support/fault_worker.py zygote``: a process that
imports torch and kvtier once, then forks one child per command it reads on stdin, so each
SIGKILL round costs a ``fork()`` instead of a fresh interpreter importing torch (seconds on a
busy 2-core CI machine). The zygote never runs torch code or threads itself (it forks).

Protocol (one line per message, written with a single ``os.write`` so lines never interleave):

* stdin ``writer TAG ROOT SEED ORDER_JSON`` — fork a child that opens an engine on the shared fs
  root and stores the prompts ``ORDER_JSON`` (indexes into :func:`kill_universe`) as fast as it
  can, printing ``TAG open`` once the engine runs, ``TAG stored I`` after each store returned and
  ``TAG done`` after a final drain.
* stdin ``peer TAG ROOT NAME PEER ROLE_SEED`` — scenario 2: store this role's prompt set while
  loading the peer's, barrier on ``ROOT/../done_<name>`` files, then load every peer prompt;
  prints ``TAG summary {json}`` and exits 1 on wrong bytes or lost chunks.
* stdin ``kill TAG`` — SIGKILL that child (only while the zygote has not reaped it, so a reused
  pid can never be hit).
* stdout ``zygote ready`` / ``TAG pid N`` / ``TAG exit CODE`` (``-9`` after SIGKILL).
* stdin EOF — kill every live child, reap them, exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier import KVGeometry  # noqa: E402

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 64
SENTINEL = -12345  # int16 pattern of a block no load wrote (not a value randn().half() yields as all of a block)


def geometry() -> KVGeometry:
    return KVGeometry("fault/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


SLOT_BYTES = geometry().slot_bytes(1)


def device_kv(num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    return [torch.zeros((num_blocks, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def fs_config(root: str | os.PathLike[str], slots: int, **tier_options: Any) -> dict[str, Any]:
    tier = {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **tier_options}
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": slots * SLOT_BYTES,
        "secondary_tiers": [tier],
    }


# ------------------------------------------------------------------------------------------------
# Content: every chunk's bytes are a function of its whole token prefix (like its key)
# ------------------------------------------------------------------------------------------------


def _seed_of(prefix: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


@lru_cache(maxsize=16384)
def chunk_payload(prefix: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The KV of the chunk ending ``prefix`` (one ``[2, BLOCK, HEADS, DIM]`` int16 view per layer)."""
    gen = torch.Generator().manual_seed(_seed_of(prefix))
    return tuple(
        torch.randn((2, BLOCK, HEADS, DIM), generator=gen).to(torch.float16).view(torch.int16)
        for _ in range(LAYERS)
    )


def expected_chunk(tokens: Sequence[int], c: int) -> tuple[torch.Tensor, ...]:
    return chunk_payload(tuple(tokens[: (c + 1) * BLOCK]))


def fill_prompt(kv: list[torch.Tensor], tokens: Sequence[int], blocks: Sequence[int]) -> None:
    """Write the payload of every complete chunk of ``tokens`` into ``blocks`` (one block per chunk)."""
    for c in range(len(tokens) // BLOCK):
        for layer, data in zip(kv, expected_chunk(tokens, c)):
            layer[blocks[c]].view(torch.int16).copy_(data)


def poison(kv: list[torch.Tensor], blocks: Sequence[int]) -> None:
    for layer in kv:
        for b in blocks:
            layer[b].view(torch.int16).fill_(SENTINEL)


def is_poisoned(kv: list[torch.Tensor], block: int) -> bool:
    return all(bool((layer[block].view(torch.int16) == SENTINEL).all()) for layer in kv)


def holds(kv: list[torch.Tensor], block: int, tokens: Sequence[int], c: int) -> bool:
    return all(torch.equal(layer[block].view(torch.int16), data) for layer, data in zip(kv, expected_chunk(tokens, c)))


def check_load(kv: list[torch.Tensor], tokens: Sequence[int], blocks: Sequence[int], placed: int | None) -> int:
    """Wrong blocks after a load into freshly :func:`poison`-ed ``blocks``.

    ``placed`` = what ``load`` returned (``num_computed_tokens=0``): the first ``placed // BLOCK``
    blocks must hold exactly their chunk, every other block must be untouched. ``placed=None`` (a
    cancelled load, whose result is unknown): every block is untouched or exactly its chunk.
    """
    nchunks = len(tokens) // BLOCK
    wrong = 0
    if placed is not None:
        if placed < 0 or placed % BLOCK or placed > nchunks * BLOCK:
            return nchunks or 1  # an impossible answer counts as wrong
        hit = placed // BLOCK
        for c in range(nchunks):
            ok = holds(kv, blocks[c], tokens, c) if c < hit else is_poisoned(kv, blocks[c])
            wrong += not ok
        return wrong
    for c in range(nchunks):
        wrong += not (is_poisoned(kv, blocks[c]) or holds(kv, blocks[c], tokens, c))
    return wrong


# ------------------------------------------------------------------------------------------------
# Prompt sets
# ------------------------------------------------------------------------------------------------


def make_prompts(seed: int, n: int, *, systems: int = 5, system_chunks: int = 2,
                 min_tail: int = 1, max_tail: int = 6) -> list[list[int]]:
    """``n`` prompts sharing ``systems`` system prefixes (so chunk keys chain and overlap)."""
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(1, 30_000) for _ in range(system_chunks * BLOCK)] for _ in range(systems)]
    out = []
    for j in range(n):
        tail = [rng.randrange(1, 30_000) for _ in range(rng.randint(min_tail, max_tail) * BLOCK)]
        out.append(sys_prompts[j % systems] + tail)
    return out


def kill_universe() -> list[list[int]]:
    """Every prompt a SIGKILL-round writer may store (at most 8 chunks each)."""
    return make_prompts(seed=20240501, n=240)


def peer_prompts(role_seed: int) -> list[list[int]]:
    """Scenario 2: role 0 stores prompts 0..119, role 1 prompts 60..179 (60 in common)."""
    allp = make_prompts(seed=777, n=180, systems=4, max_tail=5)
    return allp[:120] if role_seed == 0 else allp[60:]


# ------------------------------------------------------------------------------------------------
# Children
# ------------------------------------------------------------------------------------------------


def emit(tag: str, msg: str) -> None:
    os.write(1, f"{tag} {msg}\n".encode())


async def writer(tag: str, root: str, seed: int, order: list[int]) -> None:
    """Store ``order`` (indexes into the kill universe) as fast as possible; print after each."""
    universe = kill_universe()
    kv = device_kv()
    config = fs_config(root, slots=16, n_write_threads=4)
    async with kvtier.open(config, geometry(), kv) as engine:
        emit(tag, "open")
        for i in order:
            tokens = universe[i]
            blocks = list(range(len(tokens) // BLOCK))
            # store() returns once the device blocks may be reused: refill them right away.
            fill_prompt(kv, tokens, blocks)
            await engine.store(tokens, blocks)
            emit(tag, f"stored {i}")
        await engine.drain()
        emit(tag, "done")


async def peer(tag: str, root: str, name: str, peer_name: str, role_seed: int) -> int:
    """Scenario 2 (see the module docstring). Returns the exit code."""
    import anyio

    mine = peer_prompts(role_seed)
    theirs = peer_prompts(1 - role_seed)
    rng = random.Random(1000 + role_seed)
    kv = device_kv()
    stats = {"stores": 0, "loads": 0, "hits": 0, "wrong": 0, "lost_prompts": 0, "lost_chunks": 0,
             "retries": 0, "early_loads": 0}
    done_dir = Path(root).parent
    async with kvtier.open(fs_config(root, slots=32), geometry(), kv) as engine:
        order = list(range(len(mine)))
        rng.shuffle(order)
        for n, i in enumerate(order):
            tokens = mine[i]
            fill_prompt(kv, tokens, list(range(len(tokens) // BLOCK)))
            await engine.store(tokens, list(range(len(tokens) // BLOCK)))
            stats["stores"] += 1
            if n % 3 == 0:  # load what the peer may be writing right now: a miss or the right bytes
                other = theirs[rng.randrange(len(theirs))]
                blocks = list(range(32, 32 + len(other) // BLOCK))
                poison(kv, blocks)
                placed = await engine.load(other, blocks)
                stats["early_loads"] += 1
                stats["loads"] += 1
                stats["wrong"] += check_load(kv, other, blocks, placed)
        await engine.drain()
        (done_dir / f"done_{name}").write_text("1")
        with anyio.fail_after(60):
            while not (done_dir / f"done_{peer_name}").exists():
                await anyio.sleep(0.02)
        # Every chunk the peer stored is on disk now (it drained; the tier is unbounded). A MISS
        # verdict of an early load is trusted for negative_ttl_s (1 s), so retry until then.
        for tokens in theirs:
            blocks = list(range(32, 32 + len(tokens) // BLOCK))
            deadline = time.monotonic() + 5.0
            while True:
                poison(kv, blocks)
                placed = await engine.load(tokens, blocks)
                stats["loads"] += 1
                stats["wrong"] += check_load(kv, tokens, blocks, placed)
                if placed == len(tokens) // BLOCK * BLOCK or time.monotonic() > deadline:
                    break
                stats["retries"] += 1
                await anyio.sleep(0.1)
            if placed == len(tokens) // BLOCK * BLOCK:
                stats["hits"] += 1
            else:
                stats["lost_prompts"] += 1
                stats["lost_chunks"] += len(tokens) // BLOCK - placed // BLOCK
        host = engine.statistics()["0:primary"]
        stats["pinned_slots"] = host.pinned_slots
    emit(tag, "summary " + json.dumps(stats))
    return 0 if stats["wrong"] == 0 and stats["lost_chunks"] == 0 and stats["pinned_slots"] == 0 else 1


def _child(argv: list[str]) -> int:
    import anyio

    cmd, tag = argv[0], argv[1]
    try:
        if cmd == "writer":
            root, seed, order = argv[2], int(argv[3]), json.loads(argv[4])
            anyio.run(writer, tag, root, seed, order, backend="asyncio")
            return 0
        if cmd == "peer":
            root, name, peer_name, role_seed = argv[2], argv[3], argv[4], int(argv[5])
            return anyio.run(peer, tag, root, name, peer_name, role_seed, backend="asyncio")
        emit(tag, f"error unknown command {cmd!r}")
        return 2
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        traceback.print_exc()
        return 3


# ------------------------------------------------------------------------------------------------
# The zygote
# ------------------------------------------------------------------------------------------------


def zygote() -> None:
    children: dict[str, int] = {}  # tag -> pid, until reaped
    pending = b""
    emit("zygote", "ready")
    eof = False
    while not eof or children:
        if eof:  # stdin closed: the test is gone or done; take every child down
            for pid in children.values():
                os.kill(pid, signal.SIGKILL)
        ready, _, _ = select.select([] if eof else [0], [], [], 0.02)
        if ready:
            data = os.read(0, 65536)
            if not data:
                eof = True
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                parts = line.decode().split(" ", 2)
                if parts[0] == "kill":
                    pid = children.get(parts[1])
                    if pid is not None:  # not reaped yet: the pid is still this child's
                        os.kill(pid, signal.SIGKILL)
                elif parts[0] in ("writer", "peer"):
                    argv = [parts[0], parts[1], *parts[2].split(" ")]
                    pid = os.fork()
                    if pid == 0:
                        code = 1
                        try:
                            code = _child(argv)
                        finally:
                            sys.stdout.flush()
                            sys.stderr.flush()
                            os._exit(code)
                    children[parts[1]] = pid
                    emit(parts[1], f"pid {pid}")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for tag, child in list(children.items()):
                if child == pid:
                    del children[tag]
                    emit(tag, f"exit {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:  # run one child's job directly (debugging): fault_worker.py writer TAG ROOT SEED ORDER
        raise SystemExit(_child(sys.argv[1:]))
