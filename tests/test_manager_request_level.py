"""Request-aware tiers in the manager: REQUEST_LEVEL cascades, parked cascades, serving a peer.

The p2p tier builds on these; here a recording memory tier stands in for
it so that the manager's side is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_manager import SLOT, evict_all, key, settle, stack

from kvtier.context import RequestContext
from kvtier.tiers.base import ParentManager, TransferJob
from kvtier.tiers.memory import MemoryTier
from kvtier.types import LookupResult, OffloadPolicy


class ProducerTier(MemoryTier):
    """Takes the chunks of requests marked ``{"producer": ...}`` only, all of them; serves a queue
    of "remote" lookups through the manager it is given."""

    request_level_only = True
    serves_external_requests = True

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.stored_jobs: list[list[bytes]] = []
        self.remote: list[list[bytes]] = []  # key lists to look up for a peer
        self.answers: list[list[LookupResult]] = []
        self.pinned_jobs: list[TransferJob] = []

    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy:
        params = ctx.kv_transfer_params or {}
        return OffloadPolicy.REQUEST_LEVEL if "producer" in params else OffloadPolicy.CHUNK_LEVEL

    def submit_store(self, job: TransferJob) -> None:
        self.stored_jobs.append(list(job.keys))
        super().submit_store(job)

    def serve_external_requests(self, parent: ParentManager) -> None:
        while self.remote:
            keys = self.remote.pop(0)
            ctx = RequestContext(f"peer-{len(self.answers)}")
            parent.on_new_request(ctx)
            answers = [parent.lookup(k, ctx) for k in keys]
            self.answers.append(answers)
            hits = [k for k, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
            if hits:
                job = parent.create_store_job(hits, ctx)
                self.pinned_jobs.append(job)
                super().submit_store(job)  # "sent to the peer": the store job unpins when done
            parent.on_request_finished(ctx)


def producer_tier() -> dict:
    return {"type": "ProducerTier", "module_path": "test_manager_request_level", "capacity_bytes": 1 << 20}


async def offer(manager, keys: Sequence[bytes], params: dict | None = None, *, complete: bool = True):  # noqa: ANN001, ANN201
    ctx = RequestContext(f"req-{keys[0].hex()[:6]}-{id(params)}", params)
    manager.on_new_request(ctx)
    out = manager.prepare_store(list(keys), ctx)
    assert out is not None
    if complete:
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        await settle(manager)
    return ctx, out


@pytest.mark.anyio
async def test_request_level_tier_gets_every_chunk_of_its_requests_only() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}, producer_tier()]) as manager:
        plain, producer = manager.tiers
        await offer(manager, [key(1), key(2)])  # an ordinary request: not offered to the producer tier
        assert producer.stored_jobs == []
        _, out = await offer(manager, [key(1), key(2), key(3)], {"producer": 1})
        assert out.keys_to_store == [key(3)]  # the host already held 1 and 2 ...
        assert sorted(k for job in producer.stored_jobs for k in job) == [key(1), key(2), key(3)]  # ... all sent
        assert plain.statistics().bytes_written == 3 * SLOT  # chunk-level: each new chunk once
        assert manager.host.statistics().pinned_slots == 0


@pytest.mark.anyio
async def test_chunks_still_being_written_are_parked_until_ready() -> None:
    async with stack([producer_tier()]) as manager:
        (producer,) = manager.tiers
        writer, _ = await offer(manager, [key(5)], complete=False)  # another request is writing key 5
        ctx, out = await offer(manager, [key(5), key(6)], {"producer": 1}, complete=False)
        assert out.keys_to_store == [key(6)]
        manager.complete_store([key(6)], ctx)
        manager.on_request_finished(ctx)
        await settle(manager)
        assert [k for job in producer.stored_jobs for k in job] == [key(6)]
        assert manager.needs_step_end()  # key 5 is parked
        manager.complete_store([key(5)], writer)
        manager.on_request_finished(writer)
        await settle(manager)
        assert sorted(k for job in producer.stored_jobs for k in job) == [key(5), key(6)]
        assert not manager.needs_step_end() and not manager.has_pending_work()


@pytest.mark.anyio
async def test_parked_chunk_whose_write_failed_is_dropped() -> None:
    async with stack([producer_tier()]) as manager:
        (producer,) = manager.tiers
        writer, _ = await offer(manager, [key(7)], complete=False)
        ctx, _ = await offer(manager, [key(7)], {"producer": 1}, complete=False)
        manager.on_request_finished(ctx)
        manager.complete_store([key(7)], writer, success=False)
        manager.on_request_finished(writer)
        await settle(manager)
        assert producer.stored_jobs == [] and not manager.needs_step_end()


@pytest.mark.anyio
async def test_serving_a_peer_uses_the_stack_minus_the_serving_tier() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}, producer_tier()], slots=8) as manager:
        _, producer = manager.tiers
        await offer(manager, [key(1)])  # host and the memory tier
        await offer(manager, [key(2)], {"producer": 1})  # host, memory and the producer tier
        await evict_all(manager)  # host now holds neither
        await offer(manager, [key(3)])  # in host
        producer.remote.append([key(1), key(2), key(3), key(4)])
        manager.poll()
        # 1 and 2: the memory tier holds them, a promotion starts; 3: host; 4: nowhere. The
        # producer tier's own copy of 2 is not consulted.
        assert producer.answers[0] == [LookupResult.HIT_PENDING, LookupResult.HIT_PENDING,
                                       LookupResult.HIT, LookupResult.MISS]
        assert [list(j.keys) for j in producer.pinned_jobs] == [[key(3)]]
        assert manager.needs_step_end()  # the promotions wait to be submitted
        await settle(manager)
        producer.remote.append([key(1), key(2)])
        manager.poll()
        assert producer.answers[1] == [LookupResult.HIT, LookupResult.HIT]
        await settle(manager)
        assert manager.host.statistics().pinned_slots == 0
        with pytest.raises(ValueError, match="not ready"):
            manager.create_store_job(1, [key(99)], RequestContext("x"))


@pytest.mark.anyio
async def test_a_request_level_tier_gets_its_requests_chunks_at_once_whatever_its_write_policy() -> None:
    tiers = [{"type": "memory", "capacity_bytes": 1 << 20, "write_policy": "write_back"},
             {**producer_tier(), "write_policy": "write_back"}]
    async with stack(tiers) as manager:
        plain, producer = manager.tiers
        await offer(manager, [key(1), key(2)], {"producer": 1})
        assert sorted(k for job in producer.stored_jobs for k in job) == [key(1), key(2)]
        assert plain.statistics().bytes_written == 0  # chunk-level write-back: written later
        assert manager.dirty_chunks_by_tier() == {"1:memory": 2, "2:ProducerTier": 0}
        await offer(manager, [key(3)])  # an ordinary request: the producer tier does not want it
        assert manager.dirty_chunks_by_tier() == {"1:memory": 3, "2:ProducerTier": 0}
