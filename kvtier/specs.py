"""Offloading specs: which manager stack a configuration builds (``spec_name``).

``CPUOffloadingSpec`` is the host tier alone; ``TieringOffloadingSpec`` adds the configured
``secondary_tiers``. A spec outside kvtier is a subclass of :class:`OffloadingSpec` named by
``spec_name`` in the module ``spec_module_path``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.backpressure import BackpressureDetector, build_detectors
from kvtier.errors import ConfigError
from kvtier.manager import TieringManager

if TYPE_CHECKING:
    from kvtier.config import EngineConfig
    from kvtier.host.tier import HostTier
    from kvtier.tiers.base import SecondaryTier

__all__ = ["OffloadingSpec", "CPUOffloadingSpec", "TieringOffloadingSpec", "load_spec"]

logger = logging.getLogger("kvtier.specs")


class OffloadingSpec:
    """Builds the manager for a configuration; selected by ``spec_name``.

    The built-ins are :class:`CPUOffloadingSpec` (host tier only) and
    :class:`TieringOffloadingSpec` (host tier + ``secondary_tiers``). An out-of-tree spec is a
    subclass named by ``spec_name`` in the module ``spec_module_path``; it may, for example,
    return a ``TieringManager`` subclass with its own admission rules. The constructor builds the
    configured back-pressure detectors (``backpressure``, one entry per secondary tier; a bad
    class or argument raises ``ConfigError`` before any tier opens); a subclass that overrides
    :meth:`create_manager` passes ``backpressure=self.backpressure`` on to keep them acting.
    """

    #: Whether the spec accepts secondary tiers.
    supports_tiers: bool = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backpressure: tuple[BackpressureDetector | None, ...] = build_detectors(config)

    def create_manager(self, host: HostTier, tiers: Sequence[SecondaryTier]) -> TieringManager:
        return TieringManager(host, tiers, backpressure=self.backpressure)


class CPUOffloadingSpec(OffloadingSpec):
    """Host memory only."""

    supports_tiers = False

    def create_manager(self, host: HostTier, tiers: Sequence[SecondaryTier]) -> TieringManager:
        assert not tiers, "CPUOffloadingSpec has no secondary tiers"
        return TieringManager(host, ())


class TieringOffloadingSpec(OffloadingSpec):
    """Host memory plus the configured secondary tiers, asked in order."""


_BUILTIN_SPECS: dict[str, type[OffloadingSpec]] = {
    "CPUOffloadingSpec": CPUOffloadingSpec,
    "TieringOffloadingSpec": TieringOffloadingSpec,
}


def load_spec(config: EngineConfig) -> OffloadingSpec:
    """The spec named by ``config.spec_name`` (built-in, or a class in ``spec_module_path``)."""
    cls = _BUILTIN_SPECS.get(config.spec_name)
    if cls is None:
        module_path = config.spec_module_path
        try:
            module = importlib.import_module(module_path or "")
        except Exception as exc:  # ImportError, or any error the module raises while importing
            raise ConfigError(
                f"spec_module_path: cannot import {module_path!r} ({type(exc).__name__}: {exc})"
            ) from exc
        cls = getattr(module, config.spec_name, None)
        if not (isinstance(cls, type) and issubclass(cls, OffloadingSpec)):
            raise ConfigError(
                f"spec_name: {config.spec_name!r} is not an OffloadingSpec subclass in {module_path!r}"
            )
        logger.warning("using out-of-tree offloading spec %s from %r", config.spec_name, module_path)
    return cls(config)
