"""Tenant quotas in host memory (``tenant_cpu_bytes``; kvtier/host/tier.py with
kvtier/policies/quotas.py and kvtier/policies/tenant_policy.py)."""

from __future__ import annotations

import logging

import pytest

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.host.tier import HostTier
from kvtier.metrics import EngineMetrics
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.tenant_policy import TenantPolicy
from kvtier.types import LookupResult

SLOT = 100
#: A's hit rate with B present stays at least this close to A's hit rate alone (documented bound).
BOUND = 0.05


def key(name: str, i: int) -> bytes:
    return f"{name}-{i:04d}".encode() + (0).to_bytes(4, "big")


def ctx(tenant: str | None, **params: object) -> RequestContext:
    fields = dict(params)
    if tenant is not None:
        fields["tenant"] = tenant
    return RequestContext("r", fields)


def store(host: HostTier, keys: list[bytes], context: RequestContext | None) -> list[bytes]:
    out = host.prepare_store(keys, context)
    if out is None:
        return []
    host.complete_store(out.keys_to_store)
    return out.keys_to_store


def access(host: HostTier, k: bytes, context: RequestContext) -> bool:
    """A request for one chunk: a hit is touched, a miss is stored. True on a hit."""
    if host.lookup(k) is LookupResult.HIT:
        host.touch([k], context)
        return True
    store(host, [k], context)
    return False


def a_hit_rate(budgets: dict[str, int] | None, *, with_b: bool, policy: str = "lru", b_tenant: str = "b",
               rounds: int = 400) -> float:
    """A replays 8 chunks; B cycles through 40 (10x its budget of 4 chunks), 3 requests per A request;
    the cache holds 16 chunks."""
    host = HostTier(16, SLOT, eviction_policy=policy, tenant_budgets=budgets)
    a, b = ctx("a"), ctx(b_tenant)
    hits = 0
    j = 0
    for i in range(rounds):
        hits += access(host, key("a", i % 8), a)
        if with_b:
            for _ in range(3):
                access(host, key("b", j % 40), b)
                j += 1
    return hits / rounds


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_tenant_within_budget_keeps_its_hit_rate_beside_one_ten_times_over(policy: str) -> None:
    budgets = {"a": 8 * SLOT, "b": 4 * SLOT}
    alone = a_hit_rate(budgets, with_b=False, policy=policy)
    shared = a_hit_rate(budgets, with_b=True, policy=policy)
    unprotected = a_hit_rate(None, with_b=True, policy=policy)
    assert alone > 0.9
    assert shared >= alone - BOUND
    # Without budgets the same workload flushes A out: the bound above is not trivially met.
    assert unprotected < alone - 0.5


def test_an_unbudgeted_default_pool_is_evicted_before_a_tenant_within_its_budget() -> None:
    # B names no configured tenant: it shares the unlimited "default" pool, which takes any free
    # room but gives it back first.
    budgets = {"a": 8 * SLOT}
    alone = a_hit_rate(budgets, with_b=False)
    shared = a_hit_rate(budgets, with_b=True, b_tenant="someone-else")
    assert shared >= alone - BOUND


def test_a_tenant_at_its_budget_evicts_its_own_chunks_even_with_free_slots() -> None:
    host = HostTier(10, SLOT, tenant_budgets={"a": 3 * SLOT})
    a, other = ctx("a"), ctx(None)
    store(host, [key("o", 0)], other)
    for i in range(3):
        store(host, [key("a", i)], a)
    out = host.prepare_store([key("a", 3)], a)
    assert out is not None and out.keys_to_store == [key("a", 3)]
    assert out.evicted_keys == [key("a", 0)]  # its own least recent, not the other pool's
    host.complete_store(out.keys_to_store)
    assert host.lookup(key("o", 0)) is LookupResult.HIT
    stats = host.statistics().tenants
    assert stats is not None
    used = dict(zip(stats.labels, stats.bytes_used))
    assert used == {"default": SLOT, "a": 3 * SLOT}
    assert dict(zip(stats.labels, stats.evictions))["a"] == 1


def test_a_store_beyond_the_whole_budget_is_refused_and_counted() -> None:
    host = HostTier(10, SLOT, tenant_budgets={"a": 2 * SLOT})
    a = ctx("a")
    out = host.prepare_store([key("a", i) for i in range(5)], a)
    assert out is not None and out.keys_to_store == [key("a", 0), key("a", 1)]  # the head; the tail can never fit
    host.complete_store(out.keys_to_store)
    stats = host.statistics().tenants
    assert stats is not None
    assert dict(zip(stats.labels, stats.refused_stores)) == {"default": 0, "a": 3}


def test_a_tenant_whose_own_chunks_are_busy_has_no_room_until_they_are_idle() -> None:
    host = HostTier(10, SLOT, tenant_budgets={"a": 2 * SLOT})
    a = ctx("a")
    store(host, [key("a", 0), key("a", 1)], a)
    host.prepare_load([key("a", 0), key("a", 1)])  # pinned: nothing of A's may go, though slots are free
    assert host.prepare_store([key("a", 2), key("a", 3)], a) is None  # no room now: a caller may wait
    host.complete_load([key("a", 0)])
    assert host.prepare_store([key("a", 2), key("a", 3)], a) is None  # room for one is not room for both
    host.complete_load([key("a", 1)])
    out = host.prepare_store([key("a", 2), key("a", 3)], a)
    assert out is not None
    assert out.keys_to_store == [key("a", 2), key("a", 3)] and sorted(out.evicted_keys) == [key("a", 0), key("a", 1)]
    stats = host.statistics().tenants
    assert stats is not None
    assert dict(zip(stats.labels, stats.refused_stores)) == {"default": 0, "a": 0}
    assert dict(zip(stats.labels, stats.bytes_used)) == {"default": 0, "a": 2 * SLOT}


def test_a_full_tier_takes_room_from_the_unlimited_pool_never_from_a_tenant_within_budget() -> None:
    host = HostTier(4, SLOT, tenant_budgets={"a": 2 * SLOT, "b": 2 * SLOT})
    store(host, [key("a", 0), key("a", 1)], ctx("a"))
    store(host, [key("d", 0), key("d", 1)], ctx(None))  # "default": unlimited
    out = host.prepare_store([key("b", 0), key("b", 1)], ctx("b"))
    assert out is not None and sorted(out.evicted_keys) == [key("d", 0), key("d", 1)]
    host.complete_store(out.keys_to_store)
    # The unlimited pool storing into a full tier evicts... only its own: there is none left,
    # and A and B are within their budgets, which fill the tier.
    out = host.prepare_store([key("d", 2)], ctx(None))
    assert out is not None and out.evicted_keys in ([key("a", 0)], [key("b", 0)])


def test_without_budgets_the_host_tier_runs_its_plain_policy() -> None:
    host = HostTier(4, SLOT)
    assert isinstance(host.policy, LRUPolicy)
    assert host.statistics().tenants is None
    quota_host = HostTier(4, SLOT, tenant_budgets={"a": SLOT})
    assert isinstance(quota_host.policy, TenantPolicy)


def test_reset_cache_empties_every_pool() -> None:
    host = HostTier(4, SLOT, tenant_budgets={"a": 2 * SLOT})
    store(host, [key("a", 0)], ctx("a"))
    host.reset_cache()
    stats = host.statistics().tenants
    assert stats is not None and stats.bytes_used == (0, 0)
    assert store(host, [key("a", 1), key("a", 2)], ctx("a")) == [key("a", 1), key("a", 2)]


def test_metric_labels_are_the_configured_tenants_and_default_only(caplog: pytest.LogCaptureFixture) -> None:
    host = HostTier(8, SLOT, tenant_budgets={"a": 4 * SLOT, "default": 2 * SLOT})
    salt = "s3cr3t-salt-value"
    with caplog.at_level(logging.DEBUG):
        for i in range(1000):
            store(host, [key("x", i)], ctx(f"unknown-{i}", cache_salt=salt))
        store(host, [key("a", 0)], ctx("a"))
        store(host, [key("y", 0)], ctx(salt.upper()))  # invalid label: warned about, ignored
    metrics = EngineMetrics()
    metrics.add_host(host)
    text = metrics.render().decode()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("kvtier_tier_tenant_")}
    assert tenants == {"a", "default"}
    assert 'kvtier_tier_tenant_bytes_used{tenant="default",tier="0:primary"} 200.0' in text
    assert 'kvtier_tier_tenant_refused_stores_total{tenant="default",tier="0:primary"}' in text
    assert salt not in text and salt.upper() not in text
    assert salt.upper() not in caplog.text and salt not in caplog.text
    assert "ignoring tenant" in caplog.text


def test_a_budget_below_one_chunk_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=rf"tenant_cpu_bytes\.a = {SLOT - 1}: less than one chunk"):
        HostTier(10, SLOT, tenant_budgets={"b": SLOT, "a": SLOT - 1})
