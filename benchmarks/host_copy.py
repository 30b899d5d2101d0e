"""Host copy-engine throughput and host-tier lookup cost.

CPU (default): for 256 KiB, 2 MiB and 16 MiB chunks, the CPU copy engine's store (device → host)
and load (host → device) throughput, printed as a ratio of a raw ``numpy.copyto`` of the same
bytes, chunk by chunk, in the same process (buffers touched first; median of repeats). Rows:
cross-layer layout (one contiguous copy per run of blocks) with device blocks in order and
scattered (random block table), and the per-layer layout (one copy per layer per run).

``--device cuda``: the CUDA engine's GiB/s per direction instead (no ratio: the baseline is a
host memcpy); ``scripts/gpu_check.py`` measures the engine against a raw ``copy_`` instead.

Last line: the host tier's lookup cost for a 1,000-chunk prefix of host hits (µs per key).

    python benchmarks/host_copy.py [--device cpu|cuda] [--sizes 256K,2M,16M] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # run from a checkout

from kvtier.context import RequestContext
from kvtier.host.copy_engine import CopyEngine
from kvtier.host.copy_factory import make_copy_engine
from kvtier.host.copy_jobs import CopyJob
from kvtier.host.slots import SlotBuffer
from kvtier.host.tier import HostTier
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry
from kvtier.manager import TieringManager

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: Chunk size → (num_kv_heads, blocks_per_chunk) with 32 layers, block_size 16, head_dim 128, bf16:
#: a page is heads × 8 KiB, a block (all layers) heads × 256 KiB.
SHAPES: dict[int, tuple[int, int]] = {256 * KIB: (1, 1), 2 * MIB: (8, 1), 16 * MIB: (8, 8)}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", KIB), ("M", MIB), ("G", GIB)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


def geometry_for(chunk_bytes: int) -> tuple[KVGeometry, int]:
    heads, bpc = SHAPES[chunk_bytes]
    geo = KVGeometry(
        model_name="bench", num_layers=32, num_kv_heads=heads, head_dim=128, dtype="bfloat16", block_size=16
    )
    assert geo.chunk_bytes(bpc) == chunk_bytes
    return geo, bpc


def make_device_kv(geo: KVGeometry, num_blocks: int, cross_layer: bool, device: str) -> torch.Tensor | list[torch.Tensor]:
    page = geo.page_shape
    if cross_layer:
        t = torch.empty((num_blocks, geo.num_layers, *page), dtype=geo.torch_dtype, device=device)
        t.view(torch.int16).random_()  # touch every page
        return t
    layers = [torch.empty((num_blocks, *page), dtype=geo.torch_dtype, device=device) for _ in range(geo.num_layers)]
    for t in layers:
        t.view(torch.int16).random_()
    return layers


async def _time_jobs(engine: CopyEngine, jobs: Sequence[CopyJob]) -> float:
    """Seconds from submitting ``jobs`` to the last result (all must succeed)."""
    done = anyio.Event()
    results = []

    def wake() -> None:
        results.extend(engine.get_finished())
        if len(results) == len(jobs):
            done.set()

    engine.set_wakeup(wake)
    start = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    await done.wait()
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"copy failed: {failed[0]}")
    return elapsed


def measure_engine(
    chunk_bytes: int,
    cross_layer: bool,
    device: str,
    total_bytes: int,
    repeats: int,
    scattered: bool = False,
    **engine_options: int,
) -> dict[str, list[float]]:
    """Seconds per trial moving ``total_bytes`` of chunks: ``store``, ``load`` (engine) and
    ``raw_store``, ``raw_load`` (numpy.copyto), one sample of each per repeat."""
    geo, bpc = geometry_for(chunk_bytes)
    num_chunks = max(total_bytes // chunk_bytes, 1)
    num_blocks = num_chunks * bpc
    kv = make_device_kv(geo, num_blocks, cross_layer, device)
    buffer = SlotBuffer(num_chunks, geo.slot_bytes(bpc), pin_memory=(device == "cuda"))
    buffer.array.fill(0)  # fault every host page in before timing
    rng = np.random.default_rng(0)
    # Device blocks in order (a prefix allocated at once) or scattered (a fragmented block table).
    blocks = rng.permutation(num_blocks).tolist() if scattered else list(range(num_blocks))
    slots = list(range(num_chunks))
    jobs_per_trial = max(num_chunks // 8, 1)  # a few chunks per job, as a scheduler step submits
    per_job = -(-num_chunks // jobs_per_trial)

    def jobs(direction: str, base: int) -> list[CopyJob]:
        out = []
        for j, first in enumerate(range(0, num_chunks, per_job)):
            ids = slots[first : first + per_job]
            out.append(CopyJob(base + j, direction, ids, blocks[first * bpc : (first + len(ids)) * bpc]))  # type: ignore[arg-type]
        return out

    # Raw baseline: numpy.copyto of the same bytes, chunk by chunk, between touched buffers from
    # the same allocators (a torch-allocated source like the device KV, the same host slots), so
    # page sizes and cache state match and the ratio shows the engine's own overhead.
    src_tensor = torch.empty(num_chunks * chunk_bytes if device == "cpu" else 0, dtype=torch.uint8)
    src_tensor.fill_(1)
    src = src_tensor.numpy().reshape(num_chunks, -1)

    def raw(to_host: bool) -> float:
        if device != "cpu":  # GPU runs report bandwidth only
            return 0.0
        start = time.perf_counter()
        for i in range(num_chunks):
            if to_host:
                np.copyto(buffer.array[i, :chunk_bytes], src[i])
            else:
                np.copyto(src[i], buffer.array[i, :chunk_bytes])
        return time.perf_counter() - start

    # Engine and raw trials alternate so both see the same machine load; ratios are per pair.
    samples: dict[str, list[float]] = {"store": [], "load": [], "raw_store": [], "raw_load": []}

    async def main() -> None:
        engine = make_copy_engine(kv, geo, bpc, buffer, **engine_options)
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await _time_jobs(engine, jobs("to_host", 0))  # warm-up
            raw(True)
            for r in range(repeats):
                samples["store"].append(await _time_jobs(engine, jobs("to_host", 1000 * (r + 1))))
                samples["raw_store"].append(raw(True))
                samples["load"].append(await _time_jobs(engine, jobs("to_device", 1000 * (r + 1) + 500)))
                samples["raw_load"].append(raw(False))
            await engine.aclose()

    anyio.run(main)
    buffer.close()
    return samples


def measure_lookup(lookup_fn: Callable[[bytes], object], keys: Sequence[bytes], repeats: int = 20) -> float:
    """Median cost of ``lookup_fn`` per key over ``keys`` (µs/key)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for key in keys:
            lookup_fn(key)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / len(keys) * 1e6


def host_lookup_keys(n: int = 1000) -> tuple[HostTier, list[bytes]]:
    """A host tier holding an ``n``-chunk prefix (all ready), and its keys."""
    tier = HostTier(n, 4096)
    keys = [make_offload_key(i.to_bytes(32, "big")) for i in range(n)]
    out = tier.prepare_store(keys)
    assert out is not None and len(out.keys_to_store) == n
    tier.complete_store(keys)
    return tier, keys


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", default="256K,2M,16M", help="chunk sizes (of 256K, 2M, 16M)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--total", default="64M", help="bytes moved per direction per repeat")
    parser.add_argument("--threads", type=int, default=None, help="CPU engine: max_concurrent_jobs")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for size in sizes:
        if size not in SHAPES:
            raise SystemExit(f"unsupported chunk size {size}; choose from 256K, 2M, 16M")

    print(f"host copy engine ({args.device}), {total // MIB} MiB per direction per repeat, median of {args.repeats}")
    if args.device == "cpu":
        print(f"{'chunk':>8} {'layout':>12} {'blocks':>10} {'store/raw':>10} {'load/raw':>9} "
              f"{'store GiB/s':>12} {'load GiB/s':>11} {'raw GiB/s':>10}")
    else:
        print(f"{'chunk':>8} {'layout':>12} {'blocks':>10} {'store GiB/s':>12} {'load GiB/s':>11}")
    for size in sizes:
        for cross_layer, scattered in ((True, False), (True, True), (False, False)):
            options = {"max_concurrent_jobs": args.threads} if args.threads and args.device == "cpu" else {}
            samples = measure_engine(size, cross_layer, args.device, total, args.repeats, scattered, **options)
            order = "scattered" if scattered else "in order"
            store, load = statistics.median(samples["store"]), statistics.median(samples["load"])
            raw_store = statistics.median(samples["raw_store"])
            store_ratio = statistics.median(r / e for r, e in zip(samples["raw_store"], samples["store"]))
            load_ratio = statistics.median(r / e for r, e in zip(samples["raw_load"], samples["load"]))
            moved = max(total // size, 1) * size / GIB
            layout = "cross-layer" if cross_layer else "per-layer"
            label = f"{size // KIB}K" if size < MIB else f"{size // MIB}M"
            if args.device == "cpu":
                print(
                    f"{label:>8} {layout:>12} {order:>10} {store_ratio:>10.2f} {load_ratio:>9.2f} "
                    f"{moved / store:>12.2f} {moved / load:>11.2f} {moved / raw_store:>10.2f}"
                )
            else:
                print(f"{label:>8} {layout:>12} {order:>10} {moved / store:>12.2f} {moved / load:>11.2f}")

    tier, keys = host_lookup_keys(1000)
    print(f"host tier lookup, 1000-chunk prefix of host hits: {measure_lookup(tier.lookup, keys):.3f} µs/key")
    # The manager's lookup is what a scheduler calls: it walks the host tier first and returns on
    # a host hit, so for a prefix of host hits it adds only its own bookkeeping.
    manager = TieringManager(tier)
    ctx = RequestContext("bench")
    cost = measure_lookup(lambda key: manager.lookup(key, ctx), keys)
    print(f"manager lookup, 1000-chunk prefix of host hits: {cost:.3f} µs/key (target <= 2)")


if __name__ == "__main__":
    main()
