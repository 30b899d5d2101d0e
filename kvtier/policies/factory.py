"""Resolve the ``eviction_policy`` configuration value to a :class:`CachePolicy`.

Resolution order: the registry (built-ins ``lru`` and ``arc`` plus anything registered with
:meth:`CachePolicyFactory.register_cache_policy`), then, if ``cache_policy_module_path`` is
given, the attribute of that module named exactly like the requested policy (so the config
value is the class name). Registered entries are loaded lazily: a registered module is imported
only when its policy is first created.

The registry is process-wide: a registration affects only the process that creates the engine.
Importing a configured module runs its code, exactly like any other plugin path; kvtier never
imports anything that is not named by the operator's configuration.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.policies.base import CachePolicy

__all__ = ["CachePolicyFactory"]

logger = logging.getLogger(__name__)

# A dotted module path of identifiers: no relative imports, no file paths.
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def _load_class(module_path: str, class_name: str) -> type[CachePolicy]:
    """Import ``module_path`` and return its ``class_name`` attribute, checked to be a policy."""
    if not isinstance(module_path, str) or not _MODULE_PATH.match(module_path):
        raise ConfigError(f"cache_policy_module_path {module_path!r} is not a dotted module path")
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:  # any failure while importing plugin code is a config problem
        raise ConfigError(
            f"cache_policy_module_path: cannot import module {module_path!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(
            f"eviction_policy {class_name!r}: module {module_path!r} has no attribute {class_name!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(
            f"eviction_policy {class_name!r}: {module_path}.{class_name} is not a subclass of "
            "kvtier.policies.CachePolicy"
        )
    return cls


class CachePolicyFactory:
    """Class-level registry of cache policies: name → (module path, class name)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}
    _warned_out_of_tree: ClassVar[set[tuple[str, str]]] = set()

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``name`` to load ``module_path.class_name`` on first use.

        Raises ``ValueError`` if ``name`` is already registered (built-ins included). The module
        is not imported here; import problems surface as :class:`ConfigError` from :meth:`create`.
        """
        if name in cls._registry:
            raise ValueError(f"cache policy {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered_names(cls) -> list[str]:
        """The registered policy names, sorted."""
        return sorted(cls._registry)

    @classmethod
    def create(cls, name: str, capacity: int, module_path: str | None = None) -> CachePolicy:
        """A new policy instance for ``capacity`` host slots.

        Raises :class:`ConfigError` when ``name`` is neither registered nor found in
        ``module_path`` (the message lists the registered names), when the module cannot be
        imported, or when the attribute is not a :class:`CachePolicy` subclass.
        """
        entry = cls._registry.get(name)
        if entry is not None:
            return _load_class(*entry)(capacity)
        if module_path is None:
            raise ConfigError(
                f"eviction_policy {name!r} is not a registered cache policy "
                f"(registered: {', '.join(cls.registered_names())}); set "
                "cache_policy_module_path to load an out-of-tree policy class"
            )
        policy_cls = _load_class(module_path, name)
        if (module_path, name) not in cls._warned_out_of_tree:
            cls._warned_out_of_tree.add((module_path, name))
            logger.warning(
                "using out-of-tree cache policy %s from %s (experimental: not tested by kvtier)",
                name,
                module_path,
            )
        return policy_cls(capacity)


CachePolicyFactory.register_cache_policy("lru", "kvtier.policies.lru", "LRUPolicy")
CachePolicyFactory.register_cache_policy("arc", "kvtier.policies.arc", "ARCPolicy")
