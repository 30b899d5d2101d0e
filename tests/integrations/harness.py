"""Real vLLM 0.33 objects for the adapter tests: a TieringOffloadingSpec and a driver for it.

Nothing here stands in for vLLM: the spec, its manager, the primary tier and its shared mapping
are vLLM's own classes, built on CPU exactly as vLLM's scheduler builds them. The driver plays
the connector's part (the calls it makes per step, under the manager lock) and the GPU worker's
(it writes and reads the primary rows the manager hands out).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCKS_PER_CHUNK = 4
BLOCK_BYTES = 16 * 1024  # one worker's KV bytes per GPU block: a 64 KiB chunk (row)
_engines = itertools.count()


def offloading_config(extra: Mapping[str, Any], *, model: str = "/models/llama-test",
                      events: bool = False, blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> OffloadingConfig:
    """An OffloadingConfig as vLLM's connector builds it for a 1-GPU run (2 layers, fp16)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=events,
        extra_config=dict(extra),
        engine_id=f"kvtier-test-{next(_engines)}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def tiering_spec(secondary_tiers: Sequence[Mapping[str, Any]], *, num_chunks: int = 32,
                 events: bool = False, model: str = "/models/llama-test", **extra: Any) -> TieringOffloadingSpec:
    row = BLOCK_BYTES * BLOCKS_PER_CHUNK
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * row,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "secondary_tiers": [dict(t) for t in secondary_tiers],
        **extra,
    }
    return TieringOffloadingSpec(offloading_config(config, events=events, model=model))


def chunk_keys(tag: str, n: int) -> list[bytes]:
    """``n`` distinct offload keys (32-byte hashes, group 0) derived from ``tag``."""
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic bytes for ``key`` (what the "GPU" stores for it)."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Driver:
    """Plays vLLM's connector and worker around a real TieringOffloadingManager."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        self.spec = spec
        self.manager = spec.get_manager()
        self.rows = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
            spec.num_chunks, -1)
        self.row_bytes = self.rows.shape[1]
        self._req = itertools.count()

    def context(self) -> ReqContext:
        return ReqContext(req_id=f"req-{next(self._req)}", kv_transfer_params=None)

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))

    def settle(self, timeout: float = 20.0) -> None:
        """Step until no tier has work in flight (cascades written, probes answered)."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise AssertionError("the manager still has pending work")
            time.sleep(0.002)

    def store(self, keys: Sequence[bytes]) -> None:
        """Offload ``keys`` (GPU → primary → every secondary tier) and wait for the cascades."""
        ctx = self.context()
        m = self.manager
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(list(keys), ctx)
            assert out is not None, "the primary tier could not allocate"
            for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[slot] = payload(key, self.row_bytes)
            m.complete_store(list(keys), ctx)
            m.on_request_finished(ctx)
        self.settle()

    def lookup(self, keys: Sequence[bytes], timeout: float = 20.0) -> list[LookupResult]:
        """Each key's final answer (HIT after promotion, or MISS), stepping while asked to retry."""
        ctx = self.context()
        m = self.manager
        with m.lock:
            m.on_new_request(ctx)
        answers: dict[bytes, LookupResult] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(keys):
            with m.lock:
                for key in keys:
                    if key in answers:
                        continue
                    result = m.lookup(key, ctx)
                    if result in (LookupResult.HIT, LookupResult.MISS):
                        answers[key] = result
            self.step()
            if time.monotonic() > deadline:
                raise AssertionError(f"lookups unresolved after {timeout} s")
            time.sleep(0.002)
        with m.lock:
            m.on_request_finished(ctx)
        return [answers[k] for k in keys]

    def load(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The bytes the primary holds for each key after lookups (None for a MISS)."""
        results = self.lookup(keys)
        hits = [k for k, r in zip(keys, results, strict=True) if r is LookupResult.HIT]
        ctx = self.context()
        out: dict[bytes, bytes] = {}
        if hits:
            with self.manager.lock:
                spec = self.manager.prepare_load(hits, ctx)
                for key, slot in zip(hits, spec.chunk_ids, strict=True):
                    out[key] = self.rows[slot].tobytes()
                self.manager.complete_load(hits, ctx)
        return [out.get(k) for k in keys]

    def shutdown(self) -> None:
        """vLLM's shutdown, after dropping the driver's own window on the primary rows."""
        self.rows = None  # type: ignore[assignment]
        self.manager.shutdown()
