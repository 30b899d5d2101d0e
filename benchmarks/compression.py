"""Compression and encryption of stored chunks: bytes saved, CPU per GiB and throughput, in one run.

The KV is real: the bench's model (:class:`kvtier.bench.model.TinyDecoder`, seeded random weights,
``--dtype``) prefills ``--prompts`` random prompts into its paged pool, and each chunk is
``--blocks`` consecutive cross-layer blocks of that pool, exactly the bytes a host slot holds.

**Codec table** (one thread, in this process): every chunk encoded into its stored file and
decoded back (byte-identical, checked) by :class:`kvtier.tiers.codec.ChunkCodec` for each
configuration: ``plain`` (the baseline: format version 2, the payload copied and checksummed),
zstd at ``--levels`` with and without the byte-plane transform, AES-256-GCM alone and after
zstd. Per configuration: stored bytes over the payload bytes and the bytes saved, encode and
decode CPU per GiB of payload (thread CPU time), and encode/decode throughput as a ratio to
``plain`` (medians of ``--repeats`` passes, interleaved).

**fs tier end to end**: a :class:`~kvtier.tiers.fs.tier.FileSystemTier` built by the public
factory path (its ``compression`` / ``encryption`` options) stores ``--jobs`` jobs of 64 chunks of
that KV and loads them back, per configuration, in a temporary directory (``--root``), the
configurations interleaved trial by trial; figures are GiB/s of slot bytes (medians of
``--repeats``) and the ratio to the plain tier, with the bytes on disk. AES-GCM's target is at
least 0.8x of plain where the CPU has AES instructions (printed: ``aes`` in ``/proc/cpuinfo``).

    python benchmarks/compression.py [--dtype bfloat16] [--prompts 4] [--blocks 4] [--levels 1,3,6]
                                     [--repeats 5] [--jobs 2] [--threads 4] [--root DIR] [--no-fs]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fs_tier import CHUNKS_PER_JOB, run_tier_jobs  # noqa: E402  (benchmarks/fs_tier.py: one way to drive a tier)

from kvtier.bench.model import DeviceBlockPool, ModelConfig, TinyDecoder
from kvtier.config import TierConfig
from kvtier.host.slots import SlotBuffer
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry
from kvtier.tiers.base import TierContext
from kvtier.tiers.codec import ChunkCodec
from kvtier.tiers.fs.tier import FileSystemTier
from kvtier.tiers.integrity import identity

GiB = float(1 << 30)
RUN = hashlib.sha256(b"compression-bench").digest()


# --- the KV -------------------------------------------------------------------------------------
def model_chunks(dtype: str, prompts: int, blocks: int, seed: int = 0) -> tuple[list[bytes], ModelConfig]:
    """Chunks of ``blocks`` cross-layer blocks of the KV the bench's model computes for random prompts."""
    config = ModelConfig(dtype=dtype, seed=seed)
    model = TinyDecoder(config)
    tokens_per_prompt = 16 * config.block_size
    pool = DeviceBlockPool(prompts * 16, config)
    rng = random.Random(seed)
    used: list[int] = []
    for _ in range(prompts):
        prompt = [rng.randrange(config.vocab_size) for _ in range(tokens_per_prompt)]
        alloc = pool.acquire(prompt)
        model.prefill(prompt, alloc.cached_tokens, pool, alloc.block_ids)
        used += alloc.block_ids
        pool.release(alloc)
    kv = pool.kv
    chunks = []
    for start in range(0, len(used) - blocks + 1, blocks):
        ids = used[start:start + blocks]
        chunks.append(b"".join(kv[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for b in ids))
    return chunks, config


def padded(chunk: bytes) -> bytes:
    """``chunk`` padded to a page multiple, as a host slot is."""
    return chunk + bytes(-len(chunk) % 4096)


# --- codec table --------------------------------------------------------------------------------
@dataclass
class CodecRow:
    name: str
    stored: int
    payload: int
    encode_s: list[float]
    decode_s: list[float]


def key_file(directory: Path) -> str:
    path = directory / "bench.keys"
    path.write_text(f"1:{os.urandom(32).hex()}\n")
    os.chmod(path, 0o600)
    return str(path)


def configurations(levels: list[int], keys: str, dtype: str) -> dict[str, tuple[Any, Any]]:
    configs: dict[str, tuple[Any, Any]] = {"plain": (None, None)}
    for level in levels:
        configs[f"zstd-{level}"] = ({"codec": "zstd", "level": level, "transform": "none"}, None)
        if dtype in ("bfloat16", "float16"):
            configs[f"zstd-{level}+planes"] = ({"codec": "zstd", "level": level, "transform": "byte_planes"}, None)
    enc = {"key_file": keys, "key_id": 1}
    configs["aes-gcm"] = (None, enc)
    transform = "byte_planes" if dtype in ("bfloat16", "float16") else "none"
    configs[f"zstd-{levels[0]}+{'planes+' if transform == 'byte_planes' else ''}aes"] = (
        {"codec": "zstd", "level": levels[0], "transform": transform}, enc)
    return configs


def codec_table(chunks: list[bytes], configs: dict[str, tuple[Any, Any]], dtype: str, repeats: int) -> list[CodecRow]:
    slot = len(chunks[0])
    codecs = {name: ChunkCodec.from_options(c, e, dtype=dtype, slot_bytes=slot) for name, (c, e) in configs.items()}
    idents = [identity(make_offload_key(hashlib.sha256(b"%d" % i).digest()), RUN) for i in range(len(chunks))]
    src = [memoryview(mmap.mmap(-1, slot)) for _ in chunks]
    for view, chunk in zip(src, chunks):
        view[:] = chunk
    rows = {name: CodecRow(name, 0, slot * len(chunks), [], []) for name in codecs}
    images = {name: [memoryview(mmap.mmap(-1, codec.max_file_bytes)) for _ in chunks] for name, codec in codecs.items()}
    sizes = {name: [0] * len(chunks) for name in codecs}
    dst = memoryview(mmap.mmap(-1, slot))
    order = list(codecs)
    for r in range(repeats + 1):  # the first pass warms up (scratch buffers, page faults)
        for name in order if r % 2 else reversed(order):
            codec = codecs[name]
            t0 = time.thread_time()
            for i in range(len(chunks)):
                sizes[name][i] = codec.encode_into(src[i], idents[i], images[name][i])
            t1 = time.thread_time()
            for i in range(len(chunks)):
                verdict = codec.decode_into(images[name][i][:sizes[name][i]], idents[i], dst)
                if not verdict.ok:
                    raise RuntimeError(f"{name}: chunk {i} rejected ({verdict.reason})")
            t2 = time.thread_time()
            if r:
                rows[name].encode_s.append(t1 - t0)
                rows[name].decode_s.append(t2 - t1)
    for name in codecs:  # byte-identical, checked once outside the timed loops
        for i in range(len(chunks)):
            codecs[name].decode_into(images[name][i][:sizes[name][i]], idents[i], dst)
            if bytes(dst) != chunks[i]:
                raise RuntimeError(f"{name}: chunk {i} came back different")
        rows[name].stored = sum(sizes[name])
    return list(rows.values())


def print_codec_table(rows: list[CodecRow]) -> None:
    base = rows[0]
    base_enc, base_dec = statistics.median(base.encode_s), statistics.median(base.decode_s)
    print(f"{'config':<24}{'stored/payload':>15}{'saved':>8}{'enc CPU ms/GiB':>16}{'dec CPU ms/GiB':>16}"
          f"{'enc GiB/s':>11}{'dec GiB/s':>11}{'enc x plain':>13}{'dec x plain':>13}")
    for row in rows:
        gib = row.payload / GiB
        enc, dec = statistics.median(row.encode_s), statistics.median(row.decode_s)
        ratio = row.stored / row.payload
        print(f"{row.name:<24}{ratio:>15.3f}{1 - ratio:>8.1%}{1000 * enc / gib:>16.0f}{1000 * dec / gib:>16.0f}"
              f"{gib / enc:>11.2f}{gib / dec:>11.2f}{base_enc / enc:>12.2f}x{base_dec / dec:>12.2f}x")


# --- the fs tier end to end ---------------------------------------------------------------------
def geometry_of(config: ModelConfig, blocks: int) -> KVGeometry:
    return KVGeometry(config.model_name, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, dtype=config.dtype, block_size=config.block_size * blocks)


async def fs_round(root: Path, host: SlotBuffer, geometry: KVGeometry, options: dict[str, Any], jobs: int, threads: int,
                   tag: str) -> tuple[float, float, int]:
    """Store then load ``jobs`` jobs of 64 chunks through an fs tier; (store s, load s, bytes on disk)."""
    half = max(1, threads // 2)
    tier_root = root / f"tier_{tag}"
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(tier_root), "n_read_threads": half, "n_write_threads": max(1, threads - half), **options})
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    keys = [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(jobs * CHUNKS_PER_JOB)]

    async def run_jobs(is_promotion: bool) -> float:
        start = time.perf_counter()
        await run_tier_jobs(tier, host, keys, jobs, is_promotion)
        return time.perf_counter() - start

    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        try:
            store = await run_jobs(False)
            load = await run_jobs(True)
        finally:
            await tier.aclose()
    on_disk = sum(f.stat().st_size for f in tier_root.rglob("*.bin"))
    shutil.rmtree(tier_root)
    return store, load, on_disk


def fs_table(root: Path, chunks: list[bytes], model: ModelConfig, blocks: int, configs: dict[str, tuple[Any, Any]],
             args: argparse.Namespace) -> None:
    geometry = geometry_of(model, blocks)
    slot = geometry.slot_bytes(1)
    host = SlotBuffer(CHUNKS_PER_JOB, slot, pin_memory=False)
    try:
        for i in range(host.num_slots):
            host.view(i)[:] = padded(chunks[i % len(chunks)])
        # The host's slots are rewritten by the loads: the check below compares with the chunks.
        figures: dict[str, dict[str, list[float]]] = {name: {"store": [], "load": [], "disk": []} for name in configs}
        order = list(configs)
        for r in range(args.repeats):
            for name in order if r % 2 else reversed(order):
                compression, encryption = configs[name]
                options = {"compression": compression, "encryption": encryption}
                store, load, disk = anyio.run(fs_round, root, host, geometry, options, args.jobs, args.threads,
                                              f"{name}-{r}")
                figures[name]["store"].append(store)
                figures[name]["load"].append(load)
                figures[name]["disk"].append(disk)
        for i in range(host.num_slots):
            if bytes(host.view(i)) != padded(chunks[i % len(chunks)]):
                raise RuntimeError(f"slot {i} came back different")
    finally:
        host.close()
    gib = args.jobs * CHUNKS_PER_JOB * slot / GiB
    base = figures["plain"]
    base_store, base_load = statistics.median(base["store"]), statistics.median(base["load"])
    print(f"\nfs tier, {args.jobs} x {CHUNKS_PER_JOB} chunks of {slot >> 10} KiB, {args.threads} I/O threads "
          f"(page cache), medians of {args.repeats}:")
    print(f"{'config':<24}{'store GiB/s':>13}{'x plain':>9}{'load GiB/s':>12}{'x plain':>9}{'on disk':>10}")
    for name, f in figures.items():
        store, load = statistics.median(f["store"]), statistics.median(f["load"])
        print(f"{name:<24}{gib / store:>13.2f}{base_store / store:>8.2f}x{gib / load:>12.2f}{base_load / load:>8.2f}x"
              f"{statistics.median(f['disk']) / max(statistics.median(base['disk']), 1):>9.3f}x")


# --- main ----------------------------------------------------------------------------------------
def aes_instructions() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return "unknown"
    return "yes" if " aes" in flags else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--prompts", type=int, default=4, help="prompts of 16 blocks the model prefills")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per chunk")
    parser.add_argument("--levels", default="1,3,6", help="zstd levels, comma separated (the first also with AES)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2, help="fs tier: jobs of 64 chunks per trial")
    parser.add_argument("--threads", type=int, default=4, help="fs tier: I/O threads")
    parser.add_argument("--root", default=None, help="fs tier: directory to write in (default: a temp dir)")
    parser.add_argument("--no-fs", action="store_true", help="codec table only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the tiers' start-up notes (no max_bytes) are not figures
    levels = [int(x) for x in args.levels.split(",")]

    chunks, model = model_chunks(args.dtype, args.prompts, args.blocks)
    chunks = [padded(c) for c in chunks]
    print(f"KV of the bench model ({args.dtype}, {model.num_layers} layers, {model.num_kv_heads} KV heads x "
          f"{model.head_dim}): {len(chunks)} chunks of {len(chunks[0]) >> 10} KiB; AES instructions: {aes_instructions()}")
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        configs = configurations(levels, key_file(Path(tmp)), args.dtype)
        print_codec_table(codec_table(chunks, configs, args.dtype, args.repeats))
        if not args.no_fs:
            fs_table(Path(tmp), chunks, model, args.blocks, configs, args)


if __name__ == "__main__":
    main()
