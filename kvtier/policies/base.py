"""The pluggable cache-policy interface of the host tier.

A policy owns the host tier's key → :class:`~kvtier.types.ChunkStatus` map and decides which
ready, unpinned chunks leave host memory first. The host tier (``kvtier/host/tier.py``) is its
only caller and drives it synchronously from the engine's event-loop thread, so policies take no
locks and never block.

Division of labour (the contract every implementation relies on):

* **The host tier owns reference counts.** It mutates ``ChunkStatus.ref_cnt`` itself and then
  tells the policy: :meth:`CachePolicy.mark_evictable` when a count reaches 0 (store completed,
  last reader gone), :meth:`CachePolicy.mark_non_evictable` when it leaves 0 (a reader pinned it).
  A policy never changes ``ref_cnt``.
* **The host tier owns capacity.** It calls :meth:`CachePolicy.insert` only for keys that are
  absent and only after it has made room (freed slots or a successful :meth:`CachePolicy.evict`),
  so a policy never holds more than ``cache_capacity`` chunks and never evicts on its own.
* **The policy owns order.** Every recency/frequency hook (:meth:`~CachePolicy.touch`,
  :meth:`~CachePolicy.on_store_miss`, :meth:`~CachePolicy.on_request_access`,
  :meth:`~CachePolicy.on_request_finished`) only reorders; none of them adds or removes chunks.
  Hooks may name keys that are not resident: they are ignored (or feed adaptive ghost state).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence

from kvtier.context import RequestContext
from kvtier.types import ChunkStatus

__all__ = ["CachePolicy", "order_request_keys"]


def order_request_keys(
    key_groups: Iterable[Sequence[bytes]], req_context: RequestContext | None
) -> list[bytes]:
    """Flatten a request's per-group key lists into one prefix order.

    The groups are concatenated in the given order. If ``req_context`` has a recorded token
    position for **every** key, the result is stable-sorted by position, which restores prefix
    order even when store calls arrived out of order; if any key lacks a position the
    concatenation is returned as is (a partial sort would interleave unknown keys arbitrarily).
    """
    keys = [key for group in key_groups for key in group]
    if req_context is None or not keys:
        return keys
    positions: list[int] = []
    for key in keys:
        position = req_context.get_offload_key_position(key)
        if position is None:
            return keys
        positions.append(position)
    order = sorted(range(len(keys)), key=positions.__getitem__)  # sorted() is stable
    return [keys[i] for i in order]


class CachePolicy(ABC):
    """Which host-tier chunks to keep, and which to evict first.

    ``cache_capacity`` is the number of host slots; the host tier guarantees that at most that
    many chunks are inserted at once (see the module docstring for who does what). All methods
    are synchronous, non-blocking and called from one thread.
    """

    def __init__(self, cache_capacity: int) -> None:
        if isinstance(cache_capacity, bool) or not isinstance(cache_capacity, int):
            raise TypeError(f"cache_capacity must be an int, got {type(cache_capacity).__name__}")
        if cache_capacity < 1:
            raise ValueError(f"cache_capacity must be >= 1, got {cache_capacity}")
        self.cache_capacity = cache_capacity

    # --- the key -> ChunkStatus map -------------------------------------------------------------
    @abstractmethod
    def get(self, key: bytes) -> ChunkStatus | None:
        """The status of a resident chunk, or ``None``. No side effects (no recency update)."""

    @abstractmethod
    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        """Make ``key`` resident with ``chunk`` as its status.

        Preconditions (guaranteed by the host tier): ``key`` is absent and there is room for one
        more chunk. ``chunk.ref_cnt`` is normally ``-1`` (write pending); a chunk inserted with
        ``ref_cnt == 0`` is evictable at once. The policy stores ``chunk`` by reference, so the
        host tier's later ``ref_cnt`` updates are visible through :meth:`get`.
        """

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget ``key`` (a failed store, an explicit delete). Absent keys are ignored.

        Removal is not an eviction: adaptive policies do not remember removed keys as ghosts.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """Record an access to ``keys``; the **first** key ends up the most recently used.

        Pinned and write-pending chunks are reordered too; the new order takes effect when they
        become evictable. Keys that are not resident are ignored (or feed ghost state).
        """

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """``keys`` were offered for store and are not resident (called before their insert).

        The host tier calls this once per request per key. Default: :meth:`touch`.
        """
        self.touch(keys, req_context)

    def on_request_access(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """A request touched ``keys`` (resident or just inserted) for the first time. Default: no-op."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: Collection[bytes],
        reused_keys: Collection[bytes],
        req_context: RequestContext | None,
    ) -> None:
        """A request finished; ``key_groups`` are the keys it accessed, one list per KV group.

        ``insertion_only_keys`` were inserted by this request and not otherwise reused;
        ``reused_keys`` were already resident and ready when the request offered them. Called at
        most once per request and cache generation. Default: :meth:`touch` each group.
        """
        for group in key_groups:
            self.touch(group, req_context)

    # --- eviction --------------------------------------------------------------------------------
    @abstractmethod
    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Remove and return exactly ``n`` victims, in eviction order, or ``None``.

        Every victim has ``ref_cnt == 0`` and is not in ``protected``. **Atomic**: when fewer than
        ``n`` chunks are eligible the call returns ``None`` and the policy's observable state is
        unchanged. ``n <= 0`` returns ``[]``. The host tier frees the victims' slots.
        """

    @abstractmethod
    def clear(self) -> None:
        """Drop every chunk and all adaptive state (ghost lists, targets, request ranks)."""

    @abstractmethod
    def mark_evictable(self, key: bytes) -> None:
        """``key``'s ``ref_cnt`` has just reached 0 (store completed or last reader released)."""

    @abstractmethod
    def mark_non_evictable(self, key: bytes) -> None:
        """``key``'s ``ref_cnt`` has just left 0 (a reader pinned it)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident chunks (write-pending, ready and pinned alike)."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    # --- helpers for implementations ------------------------------------------------------------
    @staticmethod
    def order_request_keys(
        key_groups: Iterable[Sequence[bytes]], req_context: RequestContext | None
    ) -> list[bytes]:
        """See :func:`order_request_keys`."""
        return order_request_keys(key_groups, req_context)
