"""Per-request context handed to the manager, the host tier, the policies and every tier.

One ``RequestContext`` lives as long as its request; it is reused across steps. Components keep
their own per-request state in its *state bag* (keyed by type, so two components never collide),
and the recorded token position of each offload key lets policies restore prefix order even when
store calls arrive out of order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from kvtier.config.request import RequestParams, parse_tenant

__all__ = ["RequestContext"]

T = TypeVar("T")


class RequestContext:
    """Identity and per-request parameters of one request.

    ``kv_transfer_params`` is the raw per-request dictionary; ``params`` is its validated form
    (parsed once, on first use; bad numeric values are logged and ignored, a forbidden role
    combination raises :class:`kvtier.RequestError`).

    ``tenant`` is the label whose budgets the request's stores are charged to: the ``tenant``
    argument when given, else the ``tenant`` field of ``kv_transfer_params``; an invalid label
    is warned about and ignored (the request then counts as ``"default"``).
    """

    __slots__ = ("req_id", "kv_transfer_params", "_params", "_tenant", "_state", "_positions", "_looked_up")

    def __init__(self, req_id: str, kv_transfer_params: Mapping[str, Any] | None = None, *,
                 tenant: str | None = None) -> None:
        self.req_id = req_id
        self.kv_transfer_params = kv_transfer_params
        self._params: RequestParams | None = None
        self._tenant = parse_tenant(tenant)
        self._state: dict[type, Any] = {}
        self._positions: dict[bytes, int] = {}
        self._looked_up: dict[str, set[bytes]] = {}

    @property
    def params(self) -> RequestParams:
        if self._params is None:
            self._params = RequestParams.from_kv_transfer_params(self.kv_transfer_params)
        return self._params

    @property
    def tenant(self) -> str | None:
        """The request's tenant label (validated), or None."""
        return self._tenant if self._tenant is not None else self.params.tenant

    # --- state bag ---------------------------------------------------------------------------
    def set_state(self, obj: Any) -> None:
        """Store ``obj`` under its own type (replacing an earlier object of that type)."""
        self._state[type(obj)] = obj

    def get_state(self, cls: type[T]) -> T | None:
        """The object stored under ``cls``, or ``None``."""
        return self._state.get(cls)

    # --- key positions -----------------------------------------------------------------------
    def set_offload_key_position(self, key: bytes, position: int) -> None:
        """Record that ``key``'s chunk ends at token ``position`` of this request."""
        self._positions[key] = position

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._positions.get(key)

    # --- lookup accounting ---------------------------------------------------------------------
    def first_lookup(self, tier_label: str, key: bytes) -> bool:
        """True the first time this request looks ``key`` up in tier ``tier_label``.

        Lookup metrics count each (tier, key) once per request, as vLLM's ``chunk_queries``: a
        request that asks again while a promotion or probe is pending is not a new query.
        """
        seen = self._looked_up.get(tier_label)
        if seen is None:
            seen = self._looked_up[tier_label] = set()
        if key in seen:
            return False
        seen.add(key)
        return True

    def __repr__(self) -> str:
        return f"RequestContext(req_id={self.req_id!r})"
