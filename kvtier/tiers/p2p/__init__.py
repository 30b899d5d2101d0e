"""The p2p tier: KV chunks between kvtier instances (``type: "p2p"``).

* :mod:`.protocol` — the control messages (msgspec, strict and bounded);
* :mod:`.control` — ZeroMQ ROUTER/DEALER sockets, heartbeats, CurveZMQ auth;
* :mod:`.data` — UCX links (ucxx) with per-session tokens, tag-matched chunk transfers;
* :mod:`.roles` — what the tier hands each role: job reporting hooks, planes, identity, metrics;
* :mod:`.consumer` — sessions to producers, lookups at them, fetches into host slots;
* :mod:`.producer` — consumer sessions, parked stores, serving fetches and peers' lookups, bounds;
* :mod:`.tier` — :class:`~kvtier.tiers.p2p.tier.P2PTier`: composes the roles, dispatches control
  messages, runs the deadlines.

Importing this package imports neither zmq sockets nor ucxx; the tier does when it opens.
"""
