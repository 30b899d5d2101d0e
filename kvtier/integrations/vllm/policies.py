"""kvtier's cache policies as vLLM ``CachePolicy`` plug-ins.

vLLM's CPU offloading tier (``CPUOffloadingManager`` and its tiering subclass
``CPUPrimaryTierOffloadingManager``) keeps its chunks in a pluggable ``CachePolicy``
(``vllm.v1.kv_offload.cpu.policies.base``). This module adapts kvtier's own policies,
:class:`kvtier.policies.LRUPolicy` and :class:`kvtier.policies.ARCPolicy` (heap-based LRU,
single-pass ARC eviction), to that interface. They follow the same observable semantics as
vLLM's built-in ``"lru"`` and ``"arc"`` policies: the same victims, in the same order, for the
same sequence of manager calls.

Select one in vLLM's offloading config (``kv_connector_extra_config`` of the
``OffloadingConnector``)::

    "eviction_policy": "KvtierLRUPolicy",            # or "KvtierARCPolicy"
    "cache_policy_module_path": "kvtier.integrations.vllm.policies",

vLLM's ``CachePolicyFactory`` imports the module and instantiates the attribute named like the
policy with ``cache_capacity=<num_chunks>``.

The adapter passes objects through rather than converting them:

* **Chunks.** The kvtier policy stores vLLM's own ``ChunkStatus`` objects by reference. vLLM's
  manager updates ``ref_cnt`` in place and kvtier's policies read nothing else, so ``get()``
  and ``evict()`` hand back exactly the objects the manager inserted.
* **ARC.** :class:`KvtierARCPolicy` enables
  :attr:`kvtier.policies.ARCPolicy.promote_pending_reused_on_finish`, the one point where vLLM's
  ARC differs from kvtier's default.
* **Request contexts.** Each vLLM ``ReqContext`` is seen by kvtier through one
  :class:`kvtier.context.RequestContext` view, created on first use and cached in the vLLM
  context. The view reads token positions and keeps per-request policy state (such as LRU
  request ranks) in the vLLM context, so positions the scheduler records later are visible,
  and state lasts exactly as long as the request.

This module imports vLLM when it is imported. Import it only where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvtier.context import RequestContext
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import CachePolicy as KvtierCachePolicy
from kvtier.policies.lru import LRUPolicy

__all__ = ["KvtierARCPolicy", "KvtierLRUPolicy"]

_T = TypeVar("_T")


class _ReqContextView(RequestContext):
    """A kvtier ``RequestContext`` backed by a vLLM ``ReqContext``.

    Positions and the state bag are read from and written to the vLLM context, never copied.
    """

    __slots__ = ("_req_context",)

    def __init__(self, req_context: ReqContext) -> None:
        super().__init__(req_context.req_id, req_context.kv_transfer_params)
        self._req_context = req_context

    def set_state(self, obj: Any) -> None:
        self._req_context.set_state(obj)

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._req_context.get_state(cls)

    def set_offload_key_position(self, key: bytes, position: int) -> None:
        self._req_context.set_offload_key_position(OffloadKey(key), position)

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._req_context.get_offload_key_position(OffloadKey(key))


def _view(req_context: ReqContext | None) -> RequestContext | None:
    """The (cached) kvtier view of ``req_context``."""
    if req_context is None:
        return None
    view = req_context.get_state(_ReqContextView)
    if view is None:
        view = _ReqContextView(req_context)
        req_context.set_state(view)
    return view


def _as_sequence(keys: Iterable[OffloadKey]) -> Sequence[OffloadKey]:
    """kvtier's hooks take ordered sequences; vLLM may pass any iterable."""
    return keys if isinstance(keys, (list, tuple)) else list(keys)


class _KvtierPolicyAdapter(CachePolicy):
    """Delegates every vLLM ``CachePolicy`` call to a kvtier policy of ``kvtier_policy_cls``."""

    kvtier_policy_cls: ClassVar[type[KvtierCachePolicy]]

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.kvtier_policy: KvtierCachePolicy = self.kvtier_policy_cls(cache_capacity)

    def __len__(self) -> int:
        return len(self.kvtier_policy)

    # --- the key -> ChunkStatus map ---------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.kvtier_policy.get(key)  # type: ignore[return-value]  # vLLM's own object

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.kvtier_policy.insert(key, chunk, _view(req_context))  # type: ignore[arg-type]

    def remove(self, key: OffloadKey) -> None:
        self.kvtier_policy.remove(key)

    # --- recency / frequency hooks ----------------------------------------------------------
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.kvtier_policy.touch(_as_sequence(keys), _view(req_context))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.kvtier_policy.on_store_miss(_as_sequence(keys), _view(req_context))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.kvtier_policy.on_request_access(_as_sequence(keys), _view(req_context))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: Collection[OffloadKey],
        reused_keys: Collection[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self.kvtier_policy.on_request_finished(
            key_groups, insertion_only_keys, reused_keys, _view(req_context)
        )

    # --- eviction -----------------------------------------------------------------------------
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        return self.kvtier_policy.evict(n, protected)  # type: ignore[return-value]

    def clear(self) -> None:
        self.kvtier_policy.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.kvtier_policy.mark_evictable(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.kvtier_policy.mark_non_evictable(key)


class KvtierLRUPolicy(_KvtierPolicyAdapter):
    """vLLM ``CachePolicy`` backed by kvtier's request-aware LRU (:class:`~kvtier.policies.LRUPolicy`)."""

    kvtier_policy_cls = LRUPolicy


class _VllmARCPolicy(ARCPolicy):
    """kvtier's ARC with vLLM's one difference: at request end, a reused key counts as an access
    even if its chunk was evicted and is being stored again (write-pending) by then."""

    promote_pending_reused_on_finish = True


class KvtierARCPolicy(_KvtierPolicyAdapter):
    """vLLM ``CachePolicy`` backed by kvtier's ARC (:class:`~kvtier.policies.ARCPolicy`)."""

    kvtier_policy_cls = _VllmARCPolicy
