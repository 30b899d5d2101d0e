"""The engine: the asyncio/trio face of kvtier (``engine``), its argument checks (``arguments``)
and the layer-wise load (``layerwise``)."""
