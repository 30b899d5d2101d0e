"""An engine's assembly: its components built from the configuration, started, and closed.

Semantics callers rely on:

* :meth:`EngineParts.start` builds and starts, in this order, the warm-up endpoint's and the
  KV-event publisher's configurations (``warmup=``, ``events=``, checked before any tier opens:
  a tier may scan a directory or probe a bucket), the host tier (its buffer allocated at once, so
  a size this machine cannot hold fails at start-up), the copy engine (with ``device_kv``), every
  secondary tier, the manager (the spec's), the prefetch tracker, the publisher and the metrics
  (served when ``metrics=`` is given). Each runs in the engine's task group and wakes the engine
  through ``wake``. The warm-up endpoint (:meth:`EngineParts.serve_warmup`) starts last, once
  the engine can prefetch.
* Everything wrong with the configuration is a :class:`kvtier.ConfigError` naming its key,
  raised before the engine is yielded to its caller.
* The run's compatibility manifest (:mod:`kvtier.layout`) is resolved on construction:
  ``model_revision`` is the model description's, else the configuration's (a description and a
  configuration that both give one must agree: ConfigError otherwise); ``namespace_tag`` is the
  configuration's. :attr:`EngineParts.model` carries the revision, and :attr:`EngineParts.run_fields`
  (with both, only where set) is the one identity every secondary tier derives its namespace,
  trailer fingerprint and peer identity from.
* :meth:`EngineParts.aclose` closes every component that was built, also after a start that
  failed half-way; all are attempted, and the first error is raised again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from kvtier.config import EngineConfig, redact
from kvtier.engine.copies import DeviceCopies
from kvtier.engine.event_relay import EventRelay
from kvtier.engine.prefetch_tracker import PrefetchTracker
from kvtier.errors import ConfigError
from kvtier.manager import TieringManager
from kvtier.model import KVModel
from kvtier.specs import OffloadingSpec

if TYPE_CHECKING:

    from kvtier.host.copy_engine import CopyEngine
    from kvtier.host.copy_plan import DeviceKV
    from kvtier.host.tier import HostTier
    from kvtier.tiers.base import SecondaryTier

__all__ = ["EngineParts"]

logger = logging.getLogger("kvtier.engine.build")

#: ``cpu_bytes_to_use`` is rounded down to whole slots (as vLLM does). The remainder, under one
#: slot, is logged at INFO: nearly every byte count leaves one, and it is a negligible share of a
#: real host tier. Above this share of the configured bytes it is a WARNING: the configuration
#: probably meant a slot more.
_UNUSED_HOST_SHARE_TO_WARN = 0.1


class EngineParts:
    """The components of one engine (module docstring); their attributes are the engine's."""

    def __init__(self, config: EngineConfig, spec: OffloadingSpec, model: KVModel,
                 device_kv: DeviceKV | None, *, blocks_per_chunk: int,
                 slot_bytes: int, num_slots: int, tp_rank: int, hash_algorithm: str,
                 kv_events_enabled: bool) -> None:
        self.config = config
        self.spec = spec
        self.model = _with_revision(model, config)
        #: The run fields of this engine's namespace (module docstring).
        self.run_fields = self.model.run_fields(blocks_per_chunk, namespace_tag=config.namespace_tag)
        self.device_kv = device_kv
        self.blocks_per_chunk = blocks_per_chunk
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.tp_rank = tp_rank
        self.hash_algorithm = hash_algorithm
        self.kv_events_enabled = kv_events_enabled
        self.host: HostTier  # set by start; absent while start has not reached it
        self.copy_engine: CopyEngine | None = None
        self.copies = DeviceCopies(None)
        self.tiers: list[SecondaryTier] = []
        self.manager: TieringManager
        self.relay: EventRelay
        self.prefetches: PrefetchTracker
        self.publisher: Any = None
        self.translator: Any = None
        self.metrics: Any = None
        self.metrics_server: Any = None
        self.warmup_options: Any = None
        self.warmup_server: Any = None

    async def start(self, tg: anyio.abc.TaskGroup, wake: Callable[[], None],
                    events: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None,
                    warmup: Mapping[str, Any] | None = None) -> None:
        if warmup is not None:
            from kvtier.engine.warm_server import warmup_options  # zmq: only with warmup=

            self.warmup_options = warmup_options(warmup)
        if events is not None:
            from kvtier.events import EventTranslator, publisher_from_config  # zmq: only with events=

            self.publisher = publisher_from_config(events)
            self.translator = EventTranslator(
                self.config.self_describing_kv_events, int_hashes=self.publisher.int_hashes,
                group_specs={g: (group.event_kind, group.window) for g, group in enumerate(self.model.groups)},
            )
        self._build_host()
        if self.device_kv is not None:
            from kvtier.host.copy_factory import make_copy_engine  # torch: only with device_kv

            self.copy_engine = make_copy_engine(
                self.device_kv, self.model, self.blocks_per_chunk, self.host.buffer
            )
            self.copies = DeviceCopies(self.copy_engine)
            self.copy_engine.set_wakeup(wake)
            await tg.start(self.copy_engine.run)
        self._build_tiers()
        for tier in self.tiers:
            tier.set_wakeup(wake)
            await tg.start(tier.run)
        self.manager = self.spec.create_manager(self.host, self.tiers)
        self._check_backpressure_reached_the_manager()
        self.prefetches = PrefetchTracker(self.host, host_events=self.kv_events_enabled)
        self.relay = EventRelay(self.manager, self.publisher, self.translator,
                                self_describing=self.config.self_describing_kv_events,
                                model=self.model, blocks_per_chunk=self.blocks_per_chunk,
                                prefetches=self.prefetches)
        if self.publisher is not None:
            await tg.start(self.publisher.run)
        self._setup_metrics(metrics)

    def _build_host(self) -> None:
        from kvtier.host.tier import HostTier

        cfg = self.config
        host_bytes = self.num_slots * self.slot_bytes
        unused = cfg.cpu_bytes_to_use - host_bytes
        if unused:
            logger.log(
                logging.WARNING if unused > _UNUSED_HOST_SHARE_TO_WARN * cfg.cpu_bytes_to_use else logging.INFO,
                "cpu_bytes_to_use = %d is not a whole number of host slots: the host tier holds %d slots "
                "of %d bytes = %d bytes, %d bytes unused",
                cfg.cpu_bytes_to_use, self.num_slots, self.slot_bytes, host_bytes, unused,
            )
        self.host = HostTier(
            self.num_slots,
            self.slot_bytes,
            eviction_policy=cfg.eviction_policy,
            cache_policy_module_path=cfg.cache_policy_module_path,
            store_threshold=cfg.store_threshold,
            max_tracker_size=cfg.max_tracker_size,
            enable_events=self.kv_events_enabled,
            tenant_budgets=cfg.tenant_cpu_bytes,
        )
        try:
            _ = self.host.buffer  # allocate now: a size the machine cannot hold fails at start-up
        except ConfigError as exc:
            detail = str(exc).removeprefix("cpu_bytes_to_use: ")
            raise ConfigError(
                f"cpu_bytes_to_use: {cfg.cpu_bytes_to_use} is more than this machine can allocate: {detail}"
            ) from None

    def _build_tiers(self) -> None:
        from kvtier.tiers.base import TierContext
        from kvtier.tiers.factory import SecondaryTierFactory

        if not self.config.secondary_tiers:
            return
        if not self.spec.supports_tiers:
            raise ConfigError(
                f"secondary_tiers: spec {self.config.spec_name!r} does not take secondary tiers"
            )
        on_asyncio = _running_on_asyncio()
        run_fields = self.run_fields
        for tier_cfg in self.config.secondary_tiers:
            context = TierContext(
                index=tier_cfg.index,
                label=tier_cfg.label,
                slot_bytes=self.slot_bytes,
                host=self.host.buffer,
                geometry=self.model,
                blocks_per_chunk=self.blocks_per_chunk,
                run_fields=run_fields,
                rank=self.tp_rank,
                kv_events_enabled=self.kv_events_enabled,
                self_describing_kv_events=self.config.self_describing_kv_events,
                hash_algorithm=self.hash_algorithm,
            )
            tier = SecondaryTierFactory.create(tier_cfg, context)
            if getattr(tier, "requires_asyncio", False) and not on_asyncio:
                raise ConfigError(
                    f"secondary_tiers[{tier_cfg.index}].type: {tier_cfg.type!r} requires the asyncio "
                    "event loop, but kvtier.open() runs under another one (trio?); use asyncio or "
                    "remove the tier"
                )
            self.tiers.append(tier)

    def _check_backpressure_reached_the_manager(self) -> None:
        """A configured ``backpressure`` must act: the manager needs a detector for every tier
        that has one. An out-of-tree spec overriding ``create_manager`` can silently drop them."""
        detectors = self.manager.backpressure_detectors
        for i, tier_cfg in enumerate(self.config.secondary_tiers):
            settings = self.config.backpressure_for(tier_cfg)
            if settings is None or (i < len(detectors) and detectors[i] is not None):
                continue
            own = tier_cfg.backpressure is not None
            key = f"secondary_tiers[{tier_cfg.index}].backpressure" if own else "backpressure"
            value = redact(dict((tier_cfg.backpressure if own else self.config.backpressure) or {}))
            raise ConfigError(
                f"{key}: {value!r} is configured for tier {tier_cfg.label}, but the manager that spec "
                f"{self.config.spec_name!r} built has no back-pressure detector for it, so it would never "
                "act; a spec that overrides create_manager must pass backpressure=self.backpressure to "
                "TieringManager (or remove this key)"
            )

    def _setup_metrics(self, metrics: Mapping[str, Any] | None) -> None:
        from kvtier.metrics import EngineMetrics, serve_metrics  # prometheus_client: only once started

        self.metrics = EngineMetrics()
        self.metrics.add_host(self.host)
        for tier in self.tiers:
            self.metrics.add_tier(tier)
        self.metrics.add_manager(self.manager)
        self.metrics.add_copies(self.copies)
        self.metrics.add_prefetch(self.prefetches)
        if self.publisher is not None:
            self.metrics.add_publisher(self.publisher)
        if metrics is None:
            return
        unknown = set(metrics) - {"host", "port"}
        if unknown:
            raise ConfigError(f"metrics.{sorted(unknown)[0]}: unknown key; allowed: host, port")
        port = metrics.get("port", 9464)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics.port: {port!r} is invalid; expected an int in [0, 65535]")
        host = str(metrics.get("host", "127.0.0.1"))
        try:
            self.metrics_server = serve_metrics(self.metrics.registry, host=host, port=port)
        except OSError as exc:
            # Which key is at fault: a name that does not resolve or an address this machine
            # does not have is the host's; a port in use (or privileged) is the port's.
            key = "metrics.host" if isinstance(exc, socket.gaierror) or exc.errno in (
                errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) else "metrics.port"
            raise ConfigError(
                f"{key}: cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None

    async def serve_warmup(self, tg: anyio.abc.TaskGroup, engine: Any) -> None:
        """Start the warm-up endpoint (``warmup=``), once ``engine`` can prefetch."""
        if self.warmup_options is None:
            return
        from kvtier.engine.warm_server import WarmupServer  # zmq: only with warmup=

        self.warmup_server = WarmupServer(engine, self.warmup_options)
        await tg.start(self.warmup_server.run)
        if self.metrics is not None:
            self.metrics.add_warmup(self.warmup_server)

    async def aclose(self) -> None:
        """Close every component built (module docstring); shielded: it always runs to the end."""
        errors: list[BaseException] = []
        with anyio.CancelScope(shield=True):
            if self.warmup_server is not None:
                try:
                    await self.warmup_server.aclose()
                except Exception as exc:  # noqa: BLE001 - every component must be attempted
                    errors.append(exc)
            for tier in self.tiers:
                try:
                    await tier.aclose()
                except Exception as exc:  # noqa: BLE001 - every tier must be attempted
                    logger.exception("closing tier %s failed", tier.context.label)
                    errors.append(exc)
            if self.copy_engine is not None:
                try:
                    await self.copy_engine.aclose()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            if self.publisher is not None:
                try:
                    await self.publisher.aclose()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            if self.metrics_server is not None:
                self.metrics_server.close()
        if errors:
            raise errors[0]  # the host buffer stays alive: the tier that failed may still touch it
        if self.copy_engine is not None and not self.copy_engine.fenced:
            return  # a device copy may still read or write it: keep the buffer (the engine said so)
        host = getattr(self, "host", None)  # absent when start-up failed before building it
        if host is not None:
            host.close()


def _with_revision(model: KVModel, config: EngineConfig) -> KVModel:
    """``model`` with the run's ``model_revision``: its own, else the configuration's."""
    configured = config.model_revision
    if configured is None or model.model_revision == configured:
        return model
    if model.model_revision is not None:
        raise ConfigError(
            f"model_revision: {configured!r} in the configuration, but the model description says "
            f"{model.model_revision!r}; give it in one place, or the same in both"
        )
    return dataclasses.replace(model, model_revision=configured)


def _running_on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
