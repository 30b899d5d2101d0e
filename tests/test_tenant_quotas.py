"""A request's tenant (kvtier/config/request.py, kvtier/context.py) and the pool rules of
kvtier/policies/quotas.py."""

from __future__ import annotations

import logging

import pytest

from kvtier.config.request import REQUEST_KEYS, RequestParams
from kvtier.context import RequestContext
from kvtier.policies.quotas import DEFAULT_POOL, TenantQuotas


def test_tenant_is_a_request_key_parsed_and_validated(caplog: pytest.LogCaptureFixture) -> None:
    assert "tenant" in REQUEST_KEYS
    assert RequestParams.from_kv_transfer_params({"tenant": "team-a.prod_1"}).tenant == "team-a.prod_1"
    assert RequestParams.from_kv_transfer_params({}).tenant is None
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        for bad in ("Team", "", "-a", "a" * 33, "a b", 7, ["a"]):
            assert RequestParams.from_kv_transfer_params({"tenant": bad}).tenant is None
    assert caplog.text.count("ignoring tenant") == 7
    assert "Team" not in caplog.text  # the value is never echoed: it could be a secret


def test_the_context_carries_the_tenant() -> None:
    assert RequestContext("r", {"tenant": "a"}).tenant == "a"
    assert RequestContext("r", {"tenant": "a"}, tenant="b").tenant == "b"
    assert RequestContext("r").tenant is None
    assert RequestContext("r", tenant="NOT VALID").tenant is None


def test_pools_are_the_configured_labels_and_default() -> None:
    quotas = TenantQuotas({"b": 10, "a": 20})
    assert quotas.labels == ("default", "a", "b")
    assert quotas.budgets == (None, 20, 10)
    assert quotas.pool_of("a") == 1 and quotas.pool_of("zzz") == DEFAULT_POOL and quotas.pool_of(None) == DEFAULT_POOL
    assert quotas.pool_of_request(RequestContext("r", {"tenant": "b"})) == 2
    assert quotas.pool_of_request(None) == DEFAULT_POOL
    with pytest.raises(ValueError):
        TenantQuotas({f"t{i}": 1 for i in range(65)})
    with pytest.raises(ValueError):
        TenantQuotas({"a": 0})


def test_own_excess_and_donor_order() -> None:
    quotas = TenantQuotas({"a": 100, "b": 100, "c": 200, "default": 50})
    a, b, c = (quotas.pool_of(t) for t in "abc")
    quotas.charge(a, 90)
    assert quotas.own_excess(a, 10) == 0 and quotas.own_excess(a, 30) == 20
    quotas.charge(DEFAULT_POOL, 80)  # over its budget by 30
    quotas.charge(b, 150)  # over by 50
    quotas.charge(c, 100)
    assert quotas.over_budget(b) and not quotas.over_budget(c)
    # Over-budget pools first (most over first, capped), then the fullest relative to budget.
    assert quotas.donors(a) == [(b, 50), (DEFAULT_POOL, 30), (DEFAULT_POOL, None), (b, None), (a, None), (c, None)]
    unlimited = TenantQuotas({"a": 100})
    assert unlimited.donors(1) == [(DEFAULT_POOL, None), (1, None)]
    assert unlimited.own_excess(DEFAULT_POOL, 10**15) == 0
