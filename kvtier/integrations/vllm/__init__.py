"""kvtier inside vLLM 0.33: its tiers and cache policies at vLLM's documented plugin points.

Configuration alone adds kvtier to a vLLM deployment (README, "Using kvtier from vLLM")::

    "secondary_tiers": [{"type": "kvtier_fs", "root_dir": "/mnt/kv", "max_bytes": 500000000000}]

* ``kvtier_fs``, ``kvtier_obj``, ``kvtier_memory`` — :class:`KvtierFsTier`,
  :class:`KvtierObjTier`, :class:`KvtierMemoryTier`: vLLM ``SecondaryTierManager``s wrapping
  kvtier's tiers; every kvtier key of the tier (``max_bytes``, ``store_config``, …) is accepted
  in vLLM's tier dict and validated by kvtier (a bad one fails vLLM's start-up with
  :class:`kvtier.ConfigError`).
* ``KvtierLRUPolicy``, ``KvtierARCPolicy`` — vLLM ``CachePolicy``s backed by kvtier's
  O(log n) policies: ``"eviction_policy": "KvtierARCPolicy", "cache_policy_module_path":
  "kvtier.integrations.vllm.policies"``.
* ``model_revision`` and ``namespace_tag`` at the top level of ``kv_connector_extra_config``
  give kvtier's tiers a namespace of their own (the compatibility manifest,
  ``docs/shared-caches.md``); without them the tiers use vLLM's exact namespace.
* :func:`register` — installed as a ``vllm.general_plugins`` entry point, so every vLLM process
  knows the ``kvtier_*`` tier types without a ``module_path``.

Importing this package needs vLLM; it starts nothing. The first tier starts the process's one
kvtier event-loop thread, the last ``shutdown()`` stops it (:mod:`.loop`).
"""

from __future__ import annotations

try:
    import vllm.v1.kv_offload.tiering.base as _vllm_tiering  # the interfaces this package implements
except ImportError as exc:  # pragma: no cover - exercised where vLLM is missing
    raise ImportError(
        "kvtier.integrations.vllm needs vLLM (tested with vllm==0.33.0); it is not importable "
        f"here ({exc}). Install vLLM, or use kvtier directly with kvtier.open()."
    ) from exc

from kvtier.integrations.vllm.tiers import KvtierFsTier, KvtierMemoryTier, KvtierObjTier

del _vllm_tiering

__all__ = ["KvtierFsTier", "KvtierObjTier", "KvtierMemoryTier", "KvtierLRUPolicy", "KvtierARCPolicy",
           "register", "TIER_TYPES"]

#: The tier types :func:`register` adds to vLLM's ``SecondaryTierFactory``.
TIER_TYPES: dict[str, str] = {
    "kvtier_fs": "KvtierFsTier",
    "kvtier_obj": "KvtierObjTier",
    "kvtier_memory": "KvtierMemoryTier",
}


def register() -> None:
    """Make ``"type": "kvtier_fs"`` (and obj, memory) known to vLLM; idempotent, starts nothing.

    vLLM calls it in every process through the ``vllm.general_plugins`` entry point.
    """
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    for tier_type, class_name in TIER_TYPES.items():
        try:
            SecondaryTierFactory.register_tier(tier_type, __name__, class_name)
        except ValueError:  # registered already (the plugin ran before, in this process)
            pass


def __getattr__(name: str) -> object:
    # The policies module imports vLLM's CPU policy classes; load it only when asked for.
    if name in ("KvtierLRUPolicy", "KvtierARCPolicy"):
        from kvtier.integrations.vllm import policies

        return getattr(policies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
