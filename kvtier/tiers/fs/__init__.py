"""The fs tier: KV chunks as files under a shared ``root_dir`` (``type: "fs"``).

* :mod:`.tier` — :class:`~kvtier.tiers.fs.tier.FileSystemTier`: capacity, loads and stores, lifecycle;
* :mod:`.sync` — the start-up scan and the periodic re-syncs that keep its index true to the disk;
* :mod:`.tree` — the tree on disk: every name under ``root_dir``, ``config.json``, their limits;
* :mod:`.index` — what one process knows is on disk, with no Python object per chunk;
* :mod:`.scan` — listing a rank tree (the tier's scans and the operator commands);
* :mod:`.scan_workers` — the processes that walk big trees off the event loop's interpreter;
* :mod:`.chunks` — one chunk file: publish, read, verify, remove;
* :mod:`.pool` — the dual-queue thread pool the blocking file work runs on;
* :mod:`.beneath` — opening paths beneath the tree without following a link.
"""
