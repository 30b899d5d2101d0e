"""The p2p tier: KV chunks between kvtier instances (``type: "p2p"``).

* :mod:`.protocol` — the control messages (msgspec, strict and bounded);
* :mod:`.control` — ZeroMQ ROUTER/DEALER sockets, heartbeats, CurveZMQ auth;
* :mod:`.data` — UCX links (ucxx) with per-session tokens, tag-matched chunk transfers;
* :mod:`.tier` — :class:`~kvtier.tiers.p2p.tier.P2PTier`: sessions, roles, parking, deadlines.

Importing this package imports neither zmq sockets nor ucxx; the tier does when it opens.
"""
