"""GPU acceptance check of kvtier's CUDA path: prints PASS/FAIL per check and writes JSON.

Runs on a bare accelerator image: it needs torch with CUDA, numpy and kvtier's own dependencies
(``pip install -e .``), not the test extras, and collects no tests. On one GPU it takes a few
minutes (``--quick`` less).

    python scripts/gpu_check.py [--out gpu_check.json] [--quick]

Checks (each is one JSON record: name, passed, and what was measured):

* ``ordering[open|thread, default|side]`` — on the caller's stream (the default stream, or a side
  stream made current), a spin kernel and then a write of the KV are still pending when ``store``
  is called: the host must get the written bytes, not stale ones. Then, behind another spin, the
  caller's stream still has a write of the load's target blocks pending when ``load`` is called:
  the load must land after it, and a kernel enqueued after ``load`` returns must read the loaded
  bytes. Under ``kvtier.open`` and under ``kvtier.start_in_thread`` (calls from another thread
  than the engine's loop).
* ``issue_not_blocked[tp1|tp8]`` — issuing a store whose copies must wait behind a 200 ms spin on
  the caller's stream returns long before the spin ends (the issuing thread never waits for the
  model's compute); TP 8 is one rank of eight (its slots hold its own heads).
* ``completion_latency`` — a one-chunk store observed complete vs a raw ``copy_`` +
  ``synchronize()`` of the same bytes (medians): within 50 µs.
* ``bandwidth[layout, chunk, tp, direction]`` — GiB/s of many chunks copied by the engine vs one
  raw ``copy_`` of the same bytes between pinned host memory and the device, ≥ 0.9 for ≥ 2 MiB
  chunks; every round trip byte-checked. One row is repeated beside a busy Python thread (≥ 0.75).
* ``layerwise`` — the gaps between the groups of a 32-layer layer-wise load (median under 1 ms:
  groups are yielded as their copies are issued), and an early exit (leaving after the first
  group) that ends without a hang and leaves nothing pinned.
* ``hybrid`` — a hybrid model (full attention, a sliding window, a state group with two dtypes)
  stores a prompt and loads it into other blocks: full attention gets every block, the window only
  its last chunks (the blocks before it untouched), the state group only the state at the hit.
* ``pinned_growth`` — for an odd size, the pieces registered with ``cudaHostRegister`` add up to
  exactly the slot buffer's bytes, resident memory grows by them (not by a power of two), torch's
  caching host allocator does not grow, and closing gives them back (``VmPin``/``VmLck`` growth
  is recorded too: the driver's pinning need not show there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import anyio  # noqa: E402
import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier import KVGeometry  # noqa: E402
from kvtier.host.copy_jobs import CopyJob  # noqa: E402
from kvtier.host.cuda_copy import CudaCopyEngine  # noqa: E402
from kvtier.host.slots import SlotBuffer  # noqa: E402
from kvtier.model import KVModel  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
Record = dict[str, Any]


def spin(seconds: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for about ``seconds``."""
    torch.cuda._sleep(int(seconds * _cycles_per_second()))


_CYCLES: list[float] = []


def _cycles_per_second() -> float:
    if not _CYCLES:  # calibrate once: cycles of torch.cuda._sleep per second on this GPU
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES.append(10_000_000 / (start.elapsed_time(end) / 1000))
    return _CYCLES[0]


def geometry(layers: int = 2, heads: int = 8, tp: int = 1, block: int = 16) -> KVGeometry:
    return KVGeometry("gpu-check", num_layers=layers, num_kv_heads=heads, head_dim=128, dtype="float16",
                      block_size=block, tp_size=tp)


def per_layer_kv(geo: KVGeometry, blocks: int) -> list[torch.Tensor]:
    heads = geo.num_kv_heads // geo.tp_size
    return [torch.zeros((blocks, 2, geo.block_size, heads, geo.head_dim), dtype=torch.float16, device="cuda")
            for _ in range(geo.num_layers)]


def cross_layer_kv(geo: KVGeometry, blocks: int) -> torch.Tensor:
    heads = geo.num_kv_heads // geo.tp_size
    return torch.zeros((blocks, geo.num_layers, 2, geo.block_size, heads, geo.head_dim), dtype=torch.float16,
                       device="cuda")


def engine_config(geo: KVGeometry, slots: int, bpc: int = 1) -> dict[str, Any]:
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": slots * geo.slot_bytes(bpc),
            "blocks_per_chunk": bpc}


# --- ordering ---------------------------------------------------------------------------------------


def write_blocks(kv: list[torch.Tensor], blocks: list[int], value: float) -> None:
    """Write ``value`` into ``blocks`` of every layer, in place, on the current stream (the
    caller's KV write the ordering checks race against)."""
    for layer in kv:
        layer[blocks] = value  # index_put_: ``layer[blocks].fill_(value)`` would fill a copy


def _ordering_case(kind: str, stream_name: str) -> Record:
    geo = geometry()
    kv = per_layer_kv(geo, 32)
    tokens = list(range(4 * geo.block_size))
    source, target = [0, 1, 2, 3], [8, 9, 10, 11]
    stream = torch.cuda.current_stream() if stream_name == "default" else torch.cuda.Stream()
    outcome: Record = {}

    def write(blocks: list[int], value: float) -> None:
        spin(0.1)  # the caller's compute: the write behind it is pending when kvtier is called
        write_blocks(kv, blocks, value)

    def check(seen: list[torch.Tensor]) -> None:
        stream.synchronize()
        outcome["store_ok"] = outcome["stored"] == len(tokens)
        outcome["load_ok"] = outcome["loaded"] == len(tokens) and all(bool((s == 7.0).all()) for s in seen)

    if kind == "thread":  # the facade's calls run on its loop thread, not this one
        engine = kvtier.start_in_thread(engine_config(geo, 8), geo, kv)
        try:
            with torch.cuda.stream(stream):
                write(source, 7.0)
                outcome["stored"] = engine.store(tokens, source)
                write(target, -1.0)
                outcome["loaded"] = engine.load(tokens, target)
                seen = [layer[target].clone() for layer in kv]  # enqueued after load returned
        finally:
            engine.close()
        check(seen)
    else:
        async def main() -> list[torch.Tensor]:
            async with kvtier.open(engine_config(geo, 8), geo, kv) as engine:
                with torch.cuda.stream(stream):
                    write(source, 7.0)
                    outcome["stored"] = await engine.store(tokens, source)
                    write(target, -1.0)
                    outcome["loaded"] = await engine.load(tokens, target)
                    return [layer[target].clone() for layer in kv]

        check(anyio.run(main, backend="asyncio"))
    return {"name": f"ordering[{kind}, {stream_name}]", "passed": outcome["store_ok"] and outcome["load_ok"],
            **outcome}


# --- issuing, latency, bandwidth -----------------------------------------------------------------


class Harness:
    """A CUDA copy engine with its own pinned buffer; :meth:`run_jobs` runs a fresh engine per call
    (``run`` is once per engine) on a private event loop."""

    def __init__(self, geo: KVGeometry, kv: Any, slots: int, bpc: int) -> None:
        self.geo, self.kv, self.bpc = geo, kv, bpc
        # One rank's slots: its own heads (KVModel.rank_local), as kvtier.open sizes them.
        self.buffer = SlotBuffer(slots, KVModel.of(geo).rank_local().slot_bytes(bpc), pin_memory=True)

    def engine(self) -> CudaCopyEngine:
        return CudaCopyEngine(self.kv, self.geo, self.bpc, self.buffer)

    def close(self) -> None:
        torch.cuda.synchronize()
        self.buffer.close()

    def run_jobs(self, jobs: list[CopyJob]) -> tuple[float, list[Any]]:
        """Submit ``jobs`` at once; (seconds until the last result, the results)."""
        engine = self.engine()

        async def main() -> tuple[float, list[Any]]:
            results: list[Any] = []
            arrived = anyio.Event()

            def wake() -> None:
                results.extend(engine.get_finished())
                if len(results) >= len(jobs):
                    arrived.set()

            engine.set_wakeup(wake)
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                started = time.perf_counter()
                for job in jobs:
                    engine.submit(job)
                with anyio.fail_after(120):
                    await arrived.wait()
                elapsed = time.perf_counter() - started
                await engine.aclose()
            return elapsed, results

        return anyio.run(main, backend="asyncio")


def issue_not_blocked(tp: int) -> Record:
    geo = geometry(layers=32, heads=8, tp=tp)
    kv = per_layer_kv(geo, 64)
    harness = Harness(geo, kv, 8, 1)
    engine = harness.engine()
    try:
        spin(0.2)  # the caller's compute, still running when the store is issued
        order = engine.capture_order()
        job = CopyJob(1, "to_host", list(range(8)), list(range(8)), order=order)
        started = time.perf_counter()
        issued = engine._issue(job, order.ready)
        issue_s = time.perf_counter() - started
        issued.done.synchronize()
        spin_left = issue_s < 0.1
    finally:
        anyio.run(engine.aclose, backend="asyncio")
        harness.close()
    return {"name": f"issue_not_blocked[tp{tp}]", "passed": spin_left, "issue_ms": issue_s * 1000,
            "spin_ms": 200}


def completion_latency(repeats: int) -> Record:
    geo = geometry(layers=1, heads=2, block=16)
    kv = per_layer_kv(geo, 8)
    harness = Harness(geo, kv, 4, 1)
    try:
        engine_times = []
        for i in range(repeats):
            elapsed, results = harness.run_jobs([CopyJob(i, "to_host", [0], [1])])
            assert results[0].success, results[0]
            engine_times.append(elapsed)
        host = harness.buffer.tensor[0, : kv[0][1].numel() * 2].view(torch.float16).view(kv[0][1].shape)
        raw_times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            host.copy_(kv[0][1], non_blocking=True)
            torch.cuda.synchronize()
            raw_times.append(time.perf_counter() - started)
    finally:
        harness.close()
    engine_us, raw_us = statistics.median(engine_times) * 1e6, statistics.median(raw_times) * 1e6
    return {"name": "completion_latency", "passed": engine_us - raw_us <= 50.0, "engine_us": engine_us,
            "raw_us": raw_us, "chunk_bytes": geo.slot_bytes(1)}


def _bandwidth_case(layout: str, chunk_mib: int, tp: int, total_mib: int, busy_thread: bool = False) -> list[Record]:
    # 32 layers × 16 tokens × 128 dims × 2 bytes × K/V = 256 KiB per head per block.
    heads = 8
    bpc = max(1, chunk_mib * MIB // (32 * 2 * 16 * heads * 128 * 2))
    geo = geometry(layers=32, heads=heads, tp=tp)
    chunks = max(1, total_mib // chunk_mib)
    blocks = chunks * bpc
    kv = cross_layer_kv(geo, 2 * blocks) if layout == "cross_layer" else per_layer_kv(geo, 2 * blocks)
    tensors = [kv] if layout == "cross_layer" else kv
    for t in tensors:
        t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.float16))
    harness = Harness(geo, kv, chunks, bpc)
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors) // 2  # one half: the chunks' blocks
    stop = threading.Event()

    def python_busy() -> None:  # a thread that wants the GIL all the time (a scheduler, a tokenizer)
        count = 0
        while not stop.is_set():
            count += 1

    busy = threading.Thread(target=python_busy, daemon=True)
    records: list[Record] = []
    try:
        if busy_thread:
            busy.start()
        slots = list(range(chunks))
        store_s, results = harness.run_jobs(
            [CopyJob(i, "to_host", [i], list(range(i * bpc, (i + 1) * bpc))) for i in slots])
        ok = all(r.success for r in results)
        load_s, results = harness.run_jobs(
            [CopyJob(chunks + i, "to_device", [i], list(range(blocks + i * bpc, blocks + (i + 1) * bpc)))
             for i in slots])
        ok = ok and all(r.success for r in results)
        torch.cuda.synchronize()
        same = all(torch.equal(t[:blocks], t[blocks: 2 * blocks]) for t in tensors)
        host = torch.empty(rank_bytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(rank_bytes, dtype=torch.uint8, device="cuda")
        raw = {}
        for direction, (dst, src) in {"to_host": (host, device), "to_device": (device, host)}.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            raw[direction] = time.perf_counter() - started
    finally:
        stop.set()
        harness.close()
    for direction, seconds in (("to_host", store_s), ("to_device", load_s)):
        gibps, raw_gibps = rank_bytes / seconds / GIB, rank_bytes / raw[direction] / GIB
        ratio = gibps / raw_gibps
        name = f"bandwidth[{layout}, {chunk_mib} MiB, tp{tp}, {direction}]" + (" beside a busy thread" if busy_thread else "")
        # Beside a thread that wants the interpreter lock all the time, the copies (issued from
        # Python) may lose some bandwidth, but not starve: at least 3/4 of the raw copy's.
        records.append({"name": name, "passed": ok and same and ratio >= (0.75 if busy_thread else 0.9),
                        "gibps": gibps, "raw_gibps": raw_gibps, "ratio": ratio, "bytes_checked": same})
    return records


# --- layer-wise, pinned memory -------------------------------------------------------------------


def layerwise() -> Record:
    geo = geometry(layers=32, heads=8)
    kv = per_layer_kv(geo, 64)
    for layer in kv:
        layer.normal_()
    tokens = list(range(16 * geo.block_size))
    blocks = list(range(16))
    gaps: list[float] = []

    async def main() -> tuple[int, int]:
        async with kvtier.open(engine_config(geo, 32), geo, kv) as engine:
            await engine.store(tokens, blocks)
            last = time.perf_counter()
            async with engine.load_layerwise(tokens, list(range(16, 32))) as layers:
                async for _group in layers:
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
            async with engine.load_layerwise(tokens, list(range(32, 48))) as layers:
                async for _group in layers:
                    break  # early exit: the rest is withdrawn or waited for, then unpinned
            return len(gaps), engine.manager.host.statistics().pinned_slots

    groups, pinned = anyio.run(main, backend="asyncio")
    torch.cuda.synchronize()
    same = all(torch.equal(layer[:16], layer[16:32]) for layer in kv)
    median_gap_us = statistics.median(gaps[1:]) * 1e6 if len(gaps) > 1 else None
    # Groups are yielded as their copies are issued: no step waits a poll interval (~1 ms before).
    return {"name": "layerwise",
            "passed": groups == 32 and pinned == 0 and same and median_gap_us is not None and median_gap_us < 1000,
            "groups": groups, "median_gap_us": median_gap_us,
            "max_gap_us": max(gaps[1:]) * 1e6 if len(gaps) > 1 else None, "pinned_after_early_exit": pinned,
            "bytes_checked": same}


def hybrid() -> Record:
    """A hybrid model (full attention, a sliding window, two state tensors of different dtypes) on
    CUDA tensors: each group loads exactly what it needs, byte for byte."""
    block, window, heads, dim = 16, 32, 8, 128
    group = kvtier.KVCacheGroup
    model = kvtier.KVModel("gpu-check/hybrid", "bfloat16", groups=(
        group.full_attention(block_size=block, layer_names=["l.0", "l.2"], num_kv_heads=heads, head_dim=dim),
        group.sliding_window(window=window, block_size=block, layer_names=["l.1"], num_kv_heads=heads, head_dim=dim),
        group.mamba(block_size=2 * block, layer_names=["l.3"], state_shapes=[(3, 256), (8, 64, 16)],
                    state_dtypes=["bfloat16", "float32"]),
    ))
    kv: dict[str, Any] = {name: torch.randn((24, 2, block, heads, dim), device="cuda").to(torch.bfloat16)
                          for name in ("l.0", "l.1", "l.2")}
    kv["l.3"] = (torch.randn((24, 3, 256), device="cuda").to(torch.bfloat16), torch.randn((24, 8, 64, 16), device="cuda"))
    reference = {name: (tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()) for name, v in kv.items()}
    tokens = list(range(8 * block))
    config = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 32 * model.slot_bytes(1)}

    async def main() -> int:
        async with kvtier.open(config, model, kv) as engine:
            await engine.store(tokens, [list(range(8)), list(range(8)), list(range(4))])
            return await engine.load(tokens, [list(range(8, 16)), list(range(8, 16)), list(range(4, 8))])

    loaded = anyio.run(main, backend="asyncio")
    torch.cuda.synchronize()
    full = all(torch.equal(kv[n][8:16], reference[n][0:8]) for n in ("l.0", "l.2"))
    window_ok = torch.equal(kv["l.1"][14:16], reference["l.1"][6:8]) and torch.equal(kv["l.1"][8:14], reference["l.1"][8:14])
    state = all(torch.equal(t[7], r[3]) for t, r in zip(kv["l.3"], reference["l.3"]))
    return {"name": "hybrid", "passed": loaded == len(tokens) and full and window_ok and state, "loaded": loaded,
            "full_attention_ok": full, "window_only_ok": window_ok, "state_ok": state}


def _status_kib() -> dict[str, int]:
    """VmRSS, VmPin and VmLck of this process in KiB (those the kernel reports)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmPin", "VmLck"):
                fields[key] = int(value.split()[0])
    return fields


def _host_allocator_bytes() -> int | None:
    """Bytes torch's caching host allocator holds (None where torch does not report it)."""
    host_memory_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_memory_stats is None:
        return None
    try:
        value = host_memory_stats().get("allocated_bytes.current")
    except (RuntimeError, AttributeError):
        return None
    return None if value is None else int(value)


def pinned_growth() -> Record:
    """The slot buffer pins exactly its bytes for an odd size: the pieces registered with
    cudaHostRegister add up to it, resident memory grows by it (pre-faulted; not by a power of
    two), torch's caching host allocator does not grow, and closing gives it all back. VmPin and
    VmLck are recorded as the kernel reports them (the driver's pinning need not show there)."""
    slot = 2 * MIB + 4096  # an odd size: a power-of-two allocator would round 3 slots to 8 MiB
    configured = 3 * slot
    before, allocator_before = _status_kib(), _host_allocator_bytes()
    buffer = SlotBuffer(3, slot, pin_memory=True)
    pinning = buffer._pinning  # noqa: SLF001 - the registered pieces, checked as they are
    registered = sum(n for _, n in pinning.pieces) if pinning is not None else 0
    during, allocator_during = _status_kib(), _host_allocator_bytes()
    buffer.close()
    after = _status_kib()
    grown = (during["VmRSS"] - before["VmRSS"]) * 1024
    released = (during["VmRSS"] - after["VmRSS"]) * 1024
    allocator_same = allocator_before is None or allocator_before == allocator_during
    passed = (registered == configured and configured <= grown < configured + MIB
              and released >= configured - 64 * 1024 and allocator_same)
    return {"name": "pinned_growth", "passed": passed, "configured_bytes": configured,
            "registered_bytes": registered, "resident_growth_bytes": grown, "released_bytes": released,
            "torch_host_allocator_unchanged": allocator_same,
            "vm_pin_growth_bytes": (during.get("VmPin", 0) - before.get("VmPin", 0)) * 1024,
            "vm_lck_growth_bytes": (during.get("VmLck", 0) - before.get("VmLck", 0)) * 1024}


# --- main -------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and bytes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    total_mib = 256 if args.quick else 1024
    checks: list[Callable[[], Record | list[Record]]] = [
        lambda: [_ordering_case(kind, stream) for kind in ("open", "thread") for stream in ("default", "side")],
        lambda: [issue_not_blocked(1), issue_not_blocked(8)],
        lambda: completion_latency(20 if args.quick else 100),
        lambda: [r for layout in ("cross_layer", "per_layer") for chunk in (2, 16)
                 for r in _bandwidth_case(layout, chunk, 1, total_mib)]
        + [r for layout in ("cross_layer", "per_layer") for r in _bandwidth_case(layout, 2, 8, total_mib)],
        lambda: _bandwidth_case("per_layer", 2, 1, total_mib, busy_thread=True),
        layerwise,
        hybrid,
        pinned_growth,
    ]
    records: list[Record] = []
    for check in checks:
        started = time.perf_counter()
        try:
            got = check()
        except Exception as exc:  # noqa: BLE001 - a crashed check is a FAIL with its reason
            got = {"name": getattr(check, "__name__", "check"), "passed": False, "error": repr(exc)}
        for record in got if isinstance(got, list) else [got]:
            record["seconds"] = round(time.perf_counter() - started, 3)
            records.append(record)
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in record.items()
                     if k not in ("name", "passed")}
            print(f"{'PASS' if record['passed'] else 'FAIL'}  {record['name']}  {shown}", flush=True)
    summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
               "passed": sum(r["passed"] for r in records), "failed": sum(not r["passed"] for r in records),
               "checks": records}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"{summary['passed']} passed, {summary['failed']} failed")
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
