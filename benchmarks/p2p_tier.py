"""Throughput of the p2p tier against raw ucxx, between the same two processes on 127.0.0.1.

Issue 14, item 11: kvtier's fetch of 64 chunks of 256 KiB and of 2 MiB between two processes,
against raw ucxx send/recv of the same sizes between the same two processes in the same run.
Target: kvtier >= 0.8 x raw.

This process is the *consumer*; it starts the *producer* as a child (``--producer``). The two
processes hold, at once, three ways of moving the chunks, and a trial of each kind alternates
with the others (the order rotates every repeat):

* **raw**: a plain ``ucxx.create_listener``/``ucxx.create_endpoint`` pair: the producer
  ``ep.send(view, tag=i)``s every chunk of a page-aligned buffer concurrently, the consumer has
  posted every ``ep.recv(view, tag=i)`` into a page-aligned buffer before telling it to start;
* **DataPlane**: the same, through kvtier's :class:`~kvtier.tiers.p2p.data.DataPlane` (token
  handshake once at set-up, then ``Link.send``/``Link.recv`` with :func:`chunk_tag` tags);
* **tier**: the full p2p tier — each process opens a kvtier engine (``kvtier.open``, on this
  asyncio loop, ``{"type": "p2p", "host": "127.0.0.1", "port": P}``) with a geometry whose host
  slot is exactly the chunk size (``blocks_per_chunk`` 1; 256 KiB: 4 layers x K/V x 16 tokens x
  8 heads x 128 dims x fp16; 2 MiB: 32 layers). Per trial the producer stores a fresh prompt of
  ``--chunks`` chunks with ``{"remote_decoder": {"kv_request_id": rid}}`` and answers "stored"
  once ``engine.store`` returned (its chunks are parked); then the consumer
  ``engine.load``s it with ``remote_prefiller`` naming the producer.

  *tier fetch GiB/s* is bytes / the tier's own fetch time: the growth of the success sum of
  its ``p2p_fetch_latency_seconds`` histogram over the trial (``_load``: from waiting for the
  session and posting the receives, through the ``Fetch`` sent, to every chunk received and the
  producer's ``TransferDone`` arrived) — the number compared with raw. *engine.load GiB/s* is
  bytes / the wall time of ``engine.load`` (adds the lookups, chunk hashing, the host->device
  copies and the request bookkeeping): informational.

All three share each process's ucxx context, and so one progress mode: kvtier's default
(:data:`~kvtier.tiers.p2p.data.PROGRESS_MODE`) unless ``--progress-mode`` sets
``UCXPY_PROGRESS_MODE`` for both processes. A raw/DataPlane trial is timed from the command line
sent to the producer to the last receive completing. Each figure is the median of ``--repeats``
trials, after one warm-up round that also checks the bytes (for the tier: every chunk came from
the p2p tier and the device blocks equal the producer's). The CPU columns are this (consumer)
process's user + system time per GiB received (for the tier: over the whole ``engine.load``).

    python benchmarks/p2p_tier.py [--repeats 7] [--chunks 64] [--sizes 256,2048] [--progress-mode M]
    python benchmarks/p2p_tier.py --tiny      # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvtier.tiers.p2p.data import DataPlane, Link, chunk_tag, progress_mode

KIB = 1024
GIB = 1024**3
KINDS = ("raw", "dataplane", "tier")
#: Geometry of the tier trials: one layer of one block (K and V, 16 tokens x 8 heads x 128 dims,
#: fp16) is 64 KiB, so a chunk (one block, all layers) of N KiB has N / 64 layers.
BLOCK_SIZE, HEADS, HEAD_DIM = 16, 8, 128
FETCH_METRIC = "p2p_fetch_latency_seconds"


def page_aligned(nbytes: int) -> memoryview:
    """A writable, page-aligned buffer (as host slots are)."""
    return memoryview(mmap.mmap(-1, nbytes))


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the tier's engines (both processes) ---------------------------------------------------------


def tier_geometry(chunk_kib: int) -> Any:
    from kvtier.layout import KVGeometry

    layer_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2
    if chunk_kib * KIB % layer_bytes:
        raise SystemExit(f"--sizes: {chunk_kib} KiB is not a multiple of {layer_bytes // KIB} KiB")
    geometry = KVGeometry(f"bench/p2p-{chunk_kib}k", num_layers=chunk_kib * KIB // layer_bytes,
                          num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16", block_size=BLOCK_SIZE)
    assert geometry.slot_bytes(1) == chunk_kib * KIB
    return geometry


def device_kv(geometry: Any, chunks: int, seed: int | None) -> list[Any]:
    """One tensor per layer of ``chunks`` blocks: zeros, or a byte pattern from ``seed``."""
    import torch

    shape = (chunks, *geometry.page_shape)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(geometry.num_layers)]
    data = torch.from_numpy(pattern(chunks * geometry.num_layers * geometry.page_bytes, seed))
    return [layer.view(torch.float16).view(shape).clone() for layer in data.chunk(geometry.num_layers)]


def prompt_tokens(trial_seed: int, chunks: int) -> list[int]:
    """A prompt no earlier trial stored (its first token differs), so the p2p tier serves it."""
    return [trial_seed * 1_000_000 + i for i in range(chunks * BLOCK_SIZE)]


@contextlib.asynccontextmanager
async def tier_engine(chunk_kib: int, chunks: int, port: int, seed: int | None):  # type: ignore[no-untyped-def]
    import kvtier

    geometry = tier_geometry(chunk_kib)
    config = {
        "spec_name": "TieringOffloadingSpec",
        # a trial's chunks, the previous trial's (until reaped or evicted), and spare
        "cpu_bytes_to_use": (2 * chunks + 8) * geometry.slot_bytes(1),
        "secondary_tiers": [{"type": "p2p", "host": "127.0.0.1", "port": port}],
    }
    device = device_kv(geometry, chunks, seed)
    async with kvtier.open(config, geometry, device, flush_timeout_s=1.0) as engine:
        yield engine, device


def fetch_histogram(engine: Any) -> tuple[float, int]:
    """(sum, count) of the p2p tier's successful fetch latencies so far."""
    for tier in engine.tiers:
        if tier.tier_type != "p2p":
            continue
        for family in tier.statistics().custom_metrics:
            if family.name == FETCH_METRIC:
                hist = family.values.get(("success",))
                if hist is None:
                    return 0.0, 0
                snap = hist.snapshot()
                return snap.total, snap.count
    raise RuntimeError(f"no p2p tier with a {FETCH_METRIC} metric")


# -- producer (child process) ----------------------------------------------------------------------


def answer(text: str) -> None:
    # Marked, so the consumer can skip whatever else reaches stdout (UCX can log there).
    os.write(1, f"@@ {text}\n".encode())


async def producer() -> None:
    import ucxx  # type: ignore[import-untyped]

    progress_mode()  # initialise ucxx the way kvtier does, for both contenders
    raw_endpoints: asyncio.Queue[object] = asyncio.Queue()

    async def on_raw(endpoint: object) -> None:
        await raw_endpoints.put(endpoint)

    listener = ucxx.create_listener(on_raw, port=0)
    plane = DataPlane()
    dp_port = await plane.start()
    token = plane.issue_token("bench")
    loop = asyncio.get_running_loop()
    answer(f"ready {listener.port} {dp_port} {token.hex()}")
    raw_ep = await raw_endpoints.get()
    link = await plane.accepted("bench", timeout=30)
    buffers: dict[int, memoryview] = {}
    engines = contextlib.AsyncExitStack()
    engine: Any = None
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            break
        words = line.split()
        if words[0] == "engine":  # engine CHUNK_KIB CHUNKS PORT SEED: open this size's engine
            chunk_kib, chunks, port, seed = map(int, words[1:])
            engine, _ = await engines.enter_async_context(tier_engine(chunk_kib, chunks, port, seed))
            answer("engine")
            continue
        if words[0] == "close":
            await engines.aclose()
            engine = None
            answer("closed")
            continue
        if words[0] == "store":  # store RID TRIAL_SEED CHUNKS
            rid, trial_seed, chunks = words[1], int(words[2]), int(words[3])
            stored = await engine.store(prompt_tokens(trial_seed, chunks), list(range(chunks)),
                                        {"remote_decoder": {"kv_request_id": rid}})
            answer(f"stored {stored}")
            continue
        kind, chunk_bytes_s, count_s, seed_s = words
        chunk_bytes, count, seed = int(chunk_bytes_s), int(count_s), int(seed_s)
        if chunk_bytes not in buffers:
            buffers[chunk_bytes] = page_aligned(chunk_bytes * count)
            np.frombuffer(buffers[chunk_bytes], dtype=np.uint8)[:] = pattern(chunk_bytes * count, seed)
        views = [buffers[chunk_bytes][i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(count)]
        if kind == "raw":
            await asyncio.gather(*(raw_ep.send(v, tag=i) for i, v in enumerate(views)))  # type: ignore[attr-defined]
        else:
            await asyncio.gather(*(link.send(v, chunk_tag("bench", seed, i)) for i, v in enumerate(views)))
        answer("sent")
    await engines.aclose()
    await link.close()
    await plane.aclose()
    await raw_ep.close()  # type: ignore[attr-defined]
    listener.close()


# -- consumer (this process) -----------------------------------------------------------------------


@dataclass
class Trial:
    seconds: float  # raw, DataPlane: wall time; tier: the tier's fetch time
    cpu_seconds: float
    load_seconds: float = 0.0  # tier: wall time of engine.load


class Peer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self) -> str:
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), 120)
            if not raw:
                raise RuntimeError("the producer process exited")
            if raw.startswith(b"@@ "):
                return raw[3:].decode().strip()

    async def expect(self, word: str) -> list[str]:
        words = (await self.line()).split()
        if not words or words[0] != word:
            raise RuntimeError(f"expected {word!r} from the producer, got {' '.join(words)!r}")
        return words[1:]

    def tell(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")


async def trial(peer: Peer, kind: str, raw_ep: object, link: Link, dst: memoryview, chunk_bytes: int,
                count: int, seed: int, check: bool) -> Trial:
    views = [dst[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(count)]
    if kind == "raw":
        receives = [asyncio.ensure_future(raw_ep.recv(v, tag=i)) for i, v in enumerate(views)]  # type: ignore[attr-defined]
    else:
        receives = [asyncio.ensure_future(link.recv(v, chunk_tag("bench", seed, i))) for i, v in enumerate(views)]
    await asyncio.sleep(0)  # let every receive be posted before the producer starts
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    peer.tell(f"{kind} {chunk_bytes} {count} {seed}")
    await asyncio.gather(*receives)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    await peer.expect("sent")
    if check and not np.array_equal(np.frombuffer(dst, dtype=np.uint8), pattern(chunk_bytes * count, seed)):
        raise RuntimeError(f"{kind}: received bytes differ from the producer's")
    return Trial(seconds, cpu)


async def tier_trial(peer: Peer, engine: Any, device: list[Any], producer_port: int, chunk_kib: int,
                     count: int, trial_seed: int, check: bool) -> Trial:
    rid = f"bench-{chunk_kib}k-{trial_seed}"
    tokens = prompt_tokens(trial_seed, count)
    peer.tell(f"store {rid} {trial_seed} {count}")
    (stored,) = await peer.expect("stored")
    if int(stored) != len(tokens):
        raise RuntimeError(f"tier: the producer stored {stored} of {len(tokens)} tokens")
    if check:
        for layer in device:
            layer.zero_()
    params = {"remote_prefiller": {"kv_request_id": rid, "remote_host": "127.0.0.1",
                                   "remote_port": producer_port}}
    sum0, n0 = fetch_histogram(engine)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    outcome = await engine.load_with_sources(tokens, list(range(count)), params)
    load_seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    sum1, n1 = fetch_histogram(engine)
    if outcome.tokens != len(tokens) or not all(label.endswith("p2p") for label in outcome.tokens_by_tier) or n1 == n0:
        raise RuntimeError(f"tier: loaded {outcome.tokens} of {len(tokens)} tokens, by tier "
                           f"{outcome.tokens_by_tier}, {n1 - n0} successful fetches")
    if check:
        import torch

        expected = device_kv(tier_geometry(chunk_kib), count, chunk_kib)
        if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(device, expected)):
            raise RuntimeError("tier: loaded device blocks differ from the producer's")
    # Fetches of one load run concurrently if the manager splits them: the union of their spans
    # is at most the sum; with one fetch per load (the usual case) the two are equal.
    return Trial(sum1 - sum0, cpu, load_seconds)


async def consumer(args: argparse.Namespace) -> None:
    import ucxx  # type: ignore[import-untyped]

    mode = progress_mode()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--producer", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    peer = Peer(proc)
    try:
        raw_port, dp_port, token_hex = await peer.expect("ready")
        raw_ep = await ucxx.create_endpoint("127.0.0.1", int(raw_port))
        plane = DataPlane()
        link = await plane.connect("127.0.0.1", int(dp_port), bytes.fromhex(token_hex), timeout=30)
        rows = []
        for chunk_kib in args.sizes:
            chunk_bytes = chunk_kib * KIB
            dst = page_aligned(chunk_bytes * args.chunks)
            results: dict[str, list[Trial]] = {kind: [] for kind in KINDS}
            producer_port, consumer_port = free_port(), free_port()
            peer.tell(f"engine {chunk_kib} {args.chunks} {producer_port} {chunk_kib}")
            await peer.expect("engine")
            async with tier_engine(chunk_kib, args.chunks, consumer_port, None) as (engine, device):
                for repeat in range(args.repeats + 1):  # the first round warms up and checks bytes
                    order = KINDS[repeat % 3:] + KINDS[:repeat % 3]
                    for kind in order:
                        if kind == "tier":
                            result = await tier_trial(peer, engine, device, producer_port, chunk_kib,
                                                      args.chunks, repeat + 1, check=repeat == 0)
                        else:
                            result = await trial(peer, kind, raw_ep, link, dst, chunk_bytes, args.chunks,
                                                 chunk_kib, check=repeat == 0)
                        if repeat:
                            results[kind].append(result)
            peer.tell("close")
            await peer.expect("closed")
            rows.append((chunk_kib, results))
        peer.tell("quit")
        await link.close()
        await plane.aclose()
        await raw_ep.close()  # type: ignore[attr-defined]
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    print_table(rows, args.chunks, mode)


def print_table(rows: list[tuple[int, dict[str, list[Trial]]]], chunks: int, mode: str) -> None:
    print(f"p2p tier: {chunks} chunks per transfer, 2 processes on 127.0.0.1 (the same pair for every "
          f"row), ucxx progress mode {mode!r}; median of each trial set")
    print(f"{'chunk':>8}  {'raw GiB/s':>9}  {'DataPlane GiB/s':>15}  {'ratio':>6}  {'tier fetch GiB/s':>16}  "
          f"{'ratio':>6}  {'engine.load GiB/s':>17}  {'raw CPU s/GiB':>13}  {'DataPlane CPU s/GiB':>19}  "
          f"{'load CPU s/GiB':>14}")
    for chunk_kib, results in rows:
        gib = chunk_kib * KIB * chunks / GIB

        def rate(kind: str) -> float:
            return statistics.median(gib / t.seconds for t in results[kind])

        def cpu(kind: str) -> float:
            return statistics.median(t.cpu_seconds / gib for t in results[kind])

        raw, ours, tier = rate("raw"), rate("dataplane"), rate("tier")
        load = statistics.median(gib / t.load_seconds for t in results["tier"])
        label = f"{chunk_kib} KiB" if chunk_kib < 1024 else f"{chunk_kib // 1024} MiB"
        print(f"{label:>8}  {raw:9.2f}  {ours:15.2f}  {ours / raw:6.2f}  {tier:16.2f}  {tier / raw:6.2f}  "
              f"{load:17.2f}  {cpu('raw'):13.3f}  {cpu('dataplane'):19.3f}  {cpu('tier'):14.3f}")
    print("ratio = DataPlane / raw and tier fetch / raw (target >= 0.8 x raw); tier fetch = the p2p "
          f"tier's {FETCH_METRIC}{{outcome=\"success\"}}; engine.load (wall, with lookups, hashing and "
          "host->device copies) is informational")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--sizes", default="256,2048", help="chunk sizes in KiB (multiples of 64), comma-separated")
    parser.add_argument("--progress-mode", choices=["thread", "blocking", "polling", "thread-polling"],
                        help="sets UCXPY_PROGRESS_MODE for both processes")
    parser.add_argument("--tiny", action="store_true", help="a few seconds: 16 chunks, 2 repeats")
    parser.add_argument("--producer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.progress_mode:
        os.environ["UCXPY_PROGRESS_MODE"] = args.progress_mode  # inherited by the producer
    if args.producer:
        asyncio.run(producer())
        return
    if args.tiny:
        args.repeats, args.chunks = 2, 16
    args.sizes = [int(s) for s in args.sizes.split(",")]
    asyncio.run(consumer(args))


if __name__ == "__main__":
    main()
