"""``SecondaryTierFactory``: from a ``TierConfig`` to a constructed :class:`SecondaryTier`.

Built-in types are lazy (module path + class name) so that creating a ``memory`` tier never
imports aiobotocore and creating an ``fs`` tier never imports the object store client.
Resolution order: the registry (built-ins and :meth:`SecondaryTierFactory.register`), then an
out-of-tree class named exactly ``config.type`` in ``config.module_path``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, ClassVar

from kvtier.config import INTERNAL_TIER_TYPES
from kvtier.errors import ConfigError
from kvtier.tiers.base import SecondaryTier, TierContext

if TYPE_CHECKING:
    from kvtier.config import TierConfig

__all__ = ["SecondaryTierFactory"]

logger = logging.getLogger(__name__)


class SecondaryTierFactory:
    """Process-wide registry of tier types (like vLLM's factories: class methods, one registry)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {
        "memory": ("kvtier.tiers.memory", "MemoryTier"),
        "faulty": ("kvtier.tiers.faulty", "FaultyTier"),
        "fs": ("kvtier.tiers.fs.tier", "FileSystemTier"),
        "obj": ("kvtier.tiers.obj", "ObjectStoreTier"),
        "p2p": ("kvtier.tiers.p2p.tier", "P2PTier"),
    }
    _warned_out_of_tree: ClassVar[set[tuple[str, str]]] = set()

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``type: name`` resolve to ``module_path:class_name`` (imported when first used).

        Raises ``ValueError`` if ``name`` is already registered (built-ins included).
        """
        if name in cls._registry:
            raise ValueError(f"tier type {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered_types(cls) -> tuple[str, ...]:
        """Every registered type name, kvtier's internal test tiers included."""
        return tuple(sorted(cls._registry))

    @classmethod
    def get_class(cls, type_name: str, module_path: str | None = None, *,
                  where: str = "secondary_tiers") -> type[SecondaryTier]:
        """The tier class for ``type_name``; ``ConfigError`` if it cannot be resolved.

        ``where`` is the config key path used in error messages.
        """
        entry = cls._registry.get(type_name)
        if entry is not None:
            module_name, class_name = entry
        elif module_path:
            module_name, class_name = module_path, type_name
        else:
            offered = [t for t in cls.registered_types() if t not in INTERNAL_TIER_TYPES]
            raise ConfigError(
                f"invalid {where}.type = {type_name!r}: unknown tier type; expected one of "
                f"{', '.join(map(repr, offered))}, or give module_path for an out-of-tree tier class"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or anything the module raises at import time
            raise ConfigError(
                f"invalid {where}.module_path: cannot import tier module {module_name!r} "
                f"for type {type_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        tier_cls = getattr(module, class_name, None)
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTier)):
            raise ConfigError(
                f"invalid {where}.type = {type_name!r}: {module_name}.{class_name} "
                f"{'does not exist' if tier_cls is None else 'is not a SecondaryTier subclass'}"
            )
        if entry is None and (module_name, class_name) not in cls._warned_out_of_tree:
            cls._warned_out_of_tree.add((module_name, class_name))
            logger.warning("using out-of-tree secondary tier %s.%s", module_name, class_name)
        return tier_cls

    @classmethod
    def create(cls, config: TierConfig, context: TierContext) -> SecondaryTier:
        """Construct the tier ``config`` describes (not yet running: start it with ``run``)."""
        where = f"secondary_tiers[{config.index}]"
        tier_cls = cls.get_class(config.type, config.module_path, where=where)
        return tier_cls(config, context)
