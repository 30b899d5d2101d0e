"""The one statement of what a secondary tier provides.

INTERFACE STUB — the machinery is being implemented; signatures and contracts below are fixed.

A secondary tier keeps chunk bytes somewhere slower and larger than host memory (a filesystem,
an object store, a peer). Every tier runs as **one anyio task group**: the manager-facing methods
(``lookup``, ``submit_store``, ``submit_load``, ``get_finished_jobs``) are synchronous,
NON-BLOCKING channel operations; worker tasks inside the tier's task group perform the I/O by
calling the few async primitives a tier author writes.

What a tier author writes (everything else is inherited)::

    class MyTier(SecondaryTier):
        tier_type = "mine"
        medium = Medium.STORAGE

        async def open(self) -> None: ...                      # connect / probe / scan
        async def close(self) -> None: ...                     # release what open() acquired
        async def contains(self, keys) -> Sequence[bool]: ...  # batched existence probe
        async def write(self, key, src: memoryview) -> None: ...
        async def read(self, key, dst: memoryview) -> None: ...
        async def delete(self, key) -> None: ...               # optional

Preconditions guaranteed by the framework:
  * ``src``/``dst`` are views of exactly one host slot (``slot_bytes`` long, page aligned), pinned
    by the manager for the whole job: nothing else writes ``src`` or reads ``dst`` meanwhile.
  * ``write``/``read`` of one job's chunks may run concurrently (bounded per direction by
    ``max_concurrent_stores`` / ``max_concurrent_loads``); the same key is never written twice
    at once by this process.
  * ``open`` runs before any other primitive; ``close`` runs once, after every worker finished.

What the implementation is responsible for:
  * ``read`` fills ``dst`` completely or raises; it never leaves unverified bytes in ``dst``
    that could be mistaken for a chunk (the framework treats a raise as a miss).
  * Raise :class:`ChunkNotFound` for an absent chunk, :class:`ChunkCorrupt` for bytes that fail
    verification (after removing them), :class:`TierIOError` with a ``reason`` for other
    failures. ``OSError`` is mapped to a reason by errno. Anything else is a bug: it fails the
    chunk, is counted under ``"internal"`` and logged with its traceback.
  * Blocking libraries are called through ``anyio.to_thread.run_sync`` with the tier's own
    ``CapacityLimiter`` (never the default one), or through threads the tier owns and joins in
    ``close``.
"""
