"""The engine: ``kvtier.open`` and the :class:`Engine` (``engine``), its assembly (``build``), its
collaborators — admission (``gate``), device copies (``copies``), load staging (``staging``),
request keys (``keying``), progress (``progress``), events (``event_relay``) — the layer-wise load
(``layerwise``), the warm-up (``prefetch``, its counters in ``prefetch_tracker``), the blocking
facade ``kvtier.start_in_thread`` (``threaded``) and the checks of call arguments (``arguments``)."""
