"""``kvtier bench``: a miniature transformer serving multi-turn chat through kvtier's public API.

Modules: ``model`` (seeded decoder + paged device KV pool with a prefix cache), ``hybrid`` (a
seeded hybrid decoder — full attention, sliding-window attention, a recurrent layer — and its
per-group device pool, for ``kvtier bench --model hybrid``), ``workload``
(round-robin multi-turn conversations), ``runner`` (strategies, lockstep runs, logits check),
``report`` (header, table, JSON, chart) and ``cli`` (``run_bench_cli``, wired to ``kvtier bench``).
"""
