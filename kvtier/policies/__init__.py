"""Host-tier cache policies: the pluggable interface, LRU, ARC and the name → policy factory.

The host tier builds its policy with ``CachePolicyFactory.create(config.eviction_policy,
num_slots, config.cache_policy_module_path)``; see :mod:`kvtier.policies.base` for the contract
between the host tier and a policy.
"""

from __future__ import annotations

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import CachePolicy, order_request_keys
from kvtier.policies.factory import CachePolicyFactory
from kvtier.policies.lru import LRUPolicy

__all__ = ["CachePolicy", "LRUPolicy", "ARCPolicy", "CachePolicyFactory", "order_request_keys"]
