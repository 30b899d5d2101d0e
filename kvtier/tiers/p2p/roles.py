"""What the p2p tier hands its two roles (:mod:`.consumer`, :mod:`.producer`).

Each role is handed only what it may call: :class:`TierHooks` (the tier's job reporting and
wake-up, nothing else of the tier), :class:`Planes` (the control and data planes and the task
group, set when the tier opens), :class:`LocalIdentity` (what a peer's handshake is checked
against), :class:`P2POptions` and the shared :class:`P2PMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from kvtier.config.tiers import tier_option
from kvtier.context import RequestContext
from kvtier.layout import run_fingerprint
from kvtier.model import KVModel
from kvtier.stats import MetricFamily
from kvtier.tiers.jobs import JobHandle, TransferJob
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.control import ControlPlane
from kvtier.tiers.p2p.data import DataPlane, Link
from kvtier.types import LookupResult

if TYPE_CHECKING:
    from kvtier.tiers.base import TierContext

__all__ = [
    "REAPED_ID_RETENTION_S", "HOUSEKEEPING_S", "LIMITS",
    "TierHooks", "Planes", "LocalIdentity", "P2POptions", "P2PMetrics", "RoleParts", "Role", "close_quietly",
]

#: How long a reaped (producer) or failed (consumer) request id is remembered.
REAPED_ID_RETENTION_S = 60.0
#: Period of the housekeeping task (timeouts are checked this often).
HOUSEKEEPING_S = 0.2
#: Labels of ``p2p_limit_refusals``: which of the producer's per-session bounds refused.
LIMITS = ("requests", "lookup_keys", "fetches", "pins")


@dataclass(frozen=True)
class TierHooks:
    """The part of the tier a role may call: its job reporting (exactly once, see
    ``SecondaryTier.open_job``), lookup and byte accounting, and wake-ups."""

    label: str
    open_job: Callable[[TransferJob], JobHandle]
    succeed_job: Callable[..., None]  # (handle, *, elapsed, nbytes)
    fail_job: Callable[[JobHandle, str], None]
    record_transfer: Callable[[str, int, float], None]  # (direction, nbytes, seconds)
    count_lookup: Callable[[bool, bytes, RequestContext | None], LookupResult]
    notify: Callable[[], None]  # wake the engine: a result, a verdict or a peer's lookup is ready
    closing: Callable[[], bool]
    update_gauges: Callable[[], None]


@dataclass(eq=False)
class Planes:
    """The control and data planes and the tier's task group; None until the tier opens."""

    control: ControlPlane | None = None
    data: DataPlane | None = None
    tg: anyio.abc.TaskGroup | None = None
    data_port: int = 0

    def violation(self, peer: str, reason: str) -> None:
        """Count a protocol violation by ``peer`` (the control plane decides what follows)."""
        if self.control is not None:
            self.control.violation(peer, reason)


@dataclass(frozen=True)
class LocalIdentity:
    """Who this instance is to its peers, and the check of a peer's handshake against it."""

    peer_id: str
    slot_bytes: int
    fingerprint: str
    seed: str  # the NONE_HASH seed (kvtier.keys.hash_seed)
    host: Any  # the SlotBuffer (``num_slots``), or None in lookup-only tests

    @classmethod
    def of(cls, peer_id: str, context: TierContext, seed: str) -> LocalIdentity:
        return cls(peer_id, context.slot_bytes, fingerprint(context), seed, context.host)

    def num_slots(self) -> int:
        host = self.host
        return max(1, getattr(host, "num_slots", 1)) if host is not None else 1

    def mismatch(self, msg: p.Connect | p.ConnectAck) -> str | None:
        """Why a peer's handshake does not match this run (``"<what>: <detail>"``), or None."""
        if msg.block_len != self.slot_bytes:
            return f"slot_bytes: peer {msg.block_len}, here {self.slot_bytes}"
        if msg.config_fingerprint and self.fingerprint and msg.config_fingerprint != self.fingerprint:
            return (f"config_fingerprint: peer {msg.config_fingerprint}, here {self.fingerprint} "
                    "(another model, dtype, block size or layout)")
        if msg.hash_seed != self.seed:
            return "hash_seed: the NONE_HASH seeds differ (set the same PYTHONHASHSEED on both)"
        return None


def fingerprint(context: TierContext) -> str:
    """16 hex of SHA-256 over the run fields (as the fs namespace) plus the page geometry.

    The run fields do not name the head count or size, and two geometries can round up to the
    same slot size: a peer whose pages hold other shapes must not pass. Nor does a peer of
    another TP rank where each rank holds its own share of the KV (run fields naming their
    parallel sizes): the rank is added then.
    """
    fields: dict[str, Any] = dict(context.run_fields)
    if "parallel_agnostic" in fields and fields.get("tp_size", 1) > 1:  # each rank holds its own share
        fields["kvtier_rank"] = context.rank  # (kvtier.model.KVModel.rank_local)
    if context.geometry is not None:
        model = KVModel.of(context.geometry)
        bpc = context.blocks_per_chunk
        if model.hybrid:  # every group's page parts, and its chunk size
            fields["kvtier_groups"] = [
                {"parts": [[list(part.shape), part.dtype, part.offset] for part in group.parts(model.dtype)],
                 "chunk_bytes": model.chunk_bytes(g, bpc)}
                for g, group in enumerate(model.groups)
            ]
        else:
            fields["kvtier_page_shape"] = list(model.groups[0].parts(model.dtype)[0].shape)
            fields["kvtier_chunk_bytes"] = model.chunk_bytes(0, bpc)
    return run_fingerprint(fields).hex()[:16] if fields else ""


@dataclass(frozen=True)
class P2POptions:
    """The tier's options, as both roles read them; their defaults are those of the p2p schema
    (``kvtier.config.tiers``)."""

    host: str
    port: int
    num_threads: int
    unbound_store_timeout_s: float
    max_peers: int
    handshake_timeout_s: float
    peer_lookup_timeout_s: float
    load_timeout_s: float
    idle_timeout_s: float

    @classmethod
    def from_config(cls, config: Any) -> P2POptions:
        """The options of a p2p ``TierConfig`` (or anything with its ``type`` and ``options``)."""
        return cls(
            host=tier_option(config, "host"),
            port=tier_option(config, "port"),
            num_threads=tier_option(config, "num_threads"),
            unbound_store_timeout_s=tier_option(config, "unbound_store_timeout_s"),
            max_peers=tier_option(config, "max_peers"),
            handshake_timeout_s=tier_option(config, "handshake_timeout_s"),
            peer_lookup_timeout_s=tier_option(config, "lookup_timeout_s"),
            load_timeout_s=tier_option(config, "load_timeout_s"),
            idle_timeout_s=tier_option(config, "idle_timeout_s"),
        )

    @property
    def transfers_in_flight(self) -> int:
        """Chunk transfers in flight per fetch, on each side."""
        return 16 * self.num_threads


class P2PMetrics:
    """The tier's metric families (declared through the tier's ``add_metric``), shared by both roles."""

    def __init__(self, add_metric: Callable[..., MetricFamily]) -> None:
        self.peers = add_metric("p2p_peers", "gauge", "Peer sessions open, by role.", ("role",))
        self.refused = add_metric("p2p_handshakes_refused", "counter", "Handshakes refused, by reason.", ("reason",))
        self.rejected = add_metric(
            "p2p_messages_rejected", "counter", "Control messages rejected, by reason.", ("reason",))
        self.bytes = add_metric("p2p_bytes", "counter", "Chunk bytes moved, by direction.", ("direction",))
        self.chunks = add_metric("p2p_chunks", "counter", "Chunks moved, by direction.", ("direction",))
        self.fetch = add_metric("p2p_fetch_latency_seconds", "histogram",
                                "Consumer: Fetch sent to all chunks received, by outcome.", ("outcome",))
        self.lookups = add_metric("p2p_lookups", "counter",
                                  "Consumer: keys probed at a peer, by outcome (hit, miss, timed_out).", ("outcome",))
        self.open_requests = add_metric(
            "p2p_open_requests", "gauge",
            "Producer: request ids consumer sessions looked up or fetched and have not finished.")
        self.parked = add_metric("p2p_parked_batches", "gauge", "Producer: store jobs parked until a consumer fetches them.")
        self.waiting = add_metric("p2p_waiting_fetches", "gauge",
                                  "Producer: consumer fetches waiting for their chunks to be stored.")
        self.reaped = add_metric("p2p_reaped_ids", "counter",
                                 "Producer: request ids whose parked stores timed out unfetched.")
        self.refused_links = add_metric(
            "p2p_data_endpoints_refused", "counter",
            "Connections to the UCX data port closed: no, a bad or a reused token, another interface.")
        self.limits = add_metric(
            "p2p_limit_refusals", "counter",
            "Producer: lookups and fetches refused by a per-session bound, by limit.", ("limit",))
        self.connections_refused = add_metric(
            "p2p_connections_refused", "counter",
            "Producer: control connections refused (CurveZMQ key not trusted, handshake failed), by reason.",
            ("reason",))
        for limit in LIMITS:
            self.limits.inc(0, limit)
        for role in ("consumer", "producer"):
            self.peers.set(0, role)
        self.parked.set(0)
        self.open_requests.set(0)
        self.waiting.set(0)


async def close_quietly(link: Link) -> None:
    """Close ``link``, shielded and bounded; a failure to close is of no interest any more."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
        try:
            await link.close()
        except Exception:
            pass


@dataclass(frozen=True)
class RoleParts:
    """What the tier hands each of its roles: its job hooks, the planes, the local identity, the
    options and the shared metrics."""

    hooks: TierHooks
    planes: Planes
    identity: LocalIdentity
    options: P2POptions
    metrics: P2PMetrics


class Role:
    """A role of the tier (:mod:`.consumer`, :mod:`.producer`): it keeps the parts it is handed."""

    def __init__(self, parts: RoleParts) -> None:
        self._hooks = parts.hooks
        self._planes = parts.planes
        self._identity = parts.identity
        self._options = parts.options
        self._metrics = parts.metrics
