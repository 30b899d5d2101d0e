"""The blocking facade: ``kvtier.start_in_thread`` and the :class:`ThreadedEngine` it returns.

Semantics callers rely on:

* The engine of :func:`kvtier.open` runs on an asyncio event loop in a background thread; every
  method of :class:`ThreadedEngine` runs its :class:`kvtier.Engine` namesake there and blocks the
  calling thread until it returns. Any number of threads may call at once.
* The methods take the arguments of their :class:`kvtier.Engine` namesakes (``help()`` and
  ``inspect.signature`` show them) and return what those return, without the ``await``.
  ``stream``/``after`` order the copies against the *calling* thread's device work: the order is
  captured in the calling thread, before the call crosses to the engine's loop.
* Every method raises :class:`kvtier.EngineClosedError` after :meth:`ThreadedEngine.close` (also
  when another thread closes the engine during the call), except
  :meth:`ThreadedEngine.statistics`, which then returns the final snapshot, and
  :meth:`ThreadedEngine.close` itself, which is idempotent.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio.from_thread

from kvtier.config import EngineConfig
from kvtier.engine.engine import Engine, open
from kvtier.engine.layerwise import BlockingLayerwiseLoad
from kvtier.errors import ConfigError, EngineClosedError, trim_traceback
from kvtier.layout import KVGeometry
from kvtier.model import KVModel

if TYPE_CHECKING:

    from kvtier.host.copy_plan import DeviceKV

__all__ = ["ThreadedEngine", "start_in_thread"]


def _blocking(name: str, *, ordered: bool = False, wrap: Callable[[Any, Any], Any] | None = None,
              returns: str | None = None, summary: str | None = None) -> Any:
    """``ThreadedEngine.<name>``: :meth:`Engine.<name>` run on the engine's loop, blocking.

    ``ordered``: the method takes ``stream``/``after``, captured here in the calling thread.
    ``wrap(facade, value)`` turns the engine's return value into the facade's (of type
    ``returns``). The docstring is ``summary`` (default: "Blocking :meth:`Engine.<name>`"), then
    the engine method's own.
    """
    method = getattr(Engine, name)

    if ordered:
        def forward(self: ThreadedEngine, *args: Any, stream: Any = None, after: Any = None, **kwargs: Any) -> Any:
            order = self._order(stream, after)
            return self._call(name, lambda: getattr(self.engine, name)(*args, **kwargs, **order))
    else:
        def forward(self: ThreadedEngine, *args: Any, **kwargs: Any) -> Any:
            return self._call(name, lambda: getattr(self.engine, name)(*args, **kwargs))

    if wrap is None:
        call = forward
    else:
        def call(self: ThreadedEngine, *args: Any, **kwargs: Any) -> Any:
            return wrap(self, forward(self, *args, **kwargs))

    call.__name__ = name
    call.__qualname__ = f"ThreadedEngine.{name}"
    call.__module__ = __name__
    signature = inspect.signature(method)
    if returns is not None:
        signature = signature.replace(return_annotation=returns)
    call.__signature__ = signature  # type: ignore[attr-defined]
    summary = summary or f"Blocking :meth:`Engine.{name}`, run on the engine's loop thread."
    call.__doc__ = f"{summary}\n\n{inspect.cleandoc(method.__doc__ or '')}"
    return call


class ThreadedEngine:
    """Blocking, thread-safe facade over an :class:`Engine` running in a background thread.

    Every method raises :class:`kvtier.EngineClosedError` after :meth:`close` (also when another
    thread closes the engine during the call), except :meth:`statistics`, which then returns the
    final snapshot, and :meth:`close` itself, which is idempotent.
    """

    def __init__(self, portal_cm: Any, portal: Any, engine_cm: Any, engine: Engine) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._engine_cm = engine_cm
        self.engine = engine
        self.manager = engine.manager
        self.chunk_tokens = engine.chunk_tokens
        self.host_bytes = engine.host_bytes
        self._closed = False  # close() was called: every method but statistics refuses
        self._loop_gone = False  # close() returned: the engine's loop thread has stopped

    def _call(self, method: str, func: Any, *args: Any) -> Any:
        """Run ``func`` on the engine's loop; a closed engine is an EngineClosedError, never a portal error."""
        if self._closed:
            raise EngineClosedError(f"ThreadedEngine.{method}(): this kvtier engine is closed; start a new one")
        try:
            return self._portal.call(func, *args)
        except EngineClosedError:
            raise
        except RuntimeError as exc:
            if self._closed:  # closed by another thread while this call waited for the portal
                raise EngineClosedError(
                    f"ThreadedEngine.{method}(): this kvtier engine was closed during the call"
                ) from exc
            raise

    def _order(self, stream: Any, after: Any) -> dict[str, Any]:
        """Capture the caller's order here, in the calling thread (its current stream is the one
        that matters, not the loop thread's), as the ``stream``/``after`` the engine is given."""
        order = self.engine.copies.capture_order(stream, after)
        return {} if order is None else {"stream": order.stream, "after": order.ready}

    load = _blocking("load", ordered=True)
    load_with_sources = _blocking("load_with_sources", ordered=True)
    store = _blocking("store", ordered=True)
    load_layerwise = _blocking(
        "load_layerwise", ordered=True, wrap=lambda facade, load: BlockingLayerwiseLoad(load, facade._call),
        returns="BlockingLayerwiseLoad",
        summary="Blocking :meth:`Engine.load_layerwise`: ``with engine.load_layerwise(...) as layers:`` then "
                "``for group in layers:``,\neach step blocking until that group is ready for the caller's next "
                "device work.")
    prefetch = _blocking("prefetch")
    cached_prefix_tokens = _blocking("cached_prefix_tokens")
    chunk_keys = _blocking("chunk_keys")
    reset_cache = _blocking("reset_cache")
    drain = _blocking("drain")

    @property
    def metrics(self) -> Any:
        """The engine's :class:`kvtier.metrics.EngineMetrics` (``.registry`` for Prometheus).

        Collecting reads counters only, so it is safe from any thread, also after :meth:`close`
        (the final values).
        """
        return self.engine.metrics

    @property
    def metrics_server(self) -> Any:
        """The ``/metrics`` HTTP server when ``metrics=`` was given (``.host``, ``.port``), else ``None``."""
        return self.engine.metrics_server

    def statistics(self) -> dict[str, Any]:
        """Snapshots of every component (:meth:`Engine.statistics`); after :meth:`close`, the final ones."""
        if self._loop_gone:  # nothing runs on the engine any more: the final counts, read here
            return self.engine.statistics()
        try:
            return self._portal.call(self.engine.statistics)  # type: ignore[no-any-return]
        except RuntimeError:
            if not self._closed:
                raise
        while not self._loop_gone:  # the loop stopped under this call; close() is finishing
            time.sleep(0.001)
        return self.engine.statistics()

    def close(self) -> None:
        """Close the engine and stop its thread. Idempotent.

        Like leaving ``kvtier.open``: first waits up to ``flush_timeout_s`` (given to
        :func:`start_in_thread`; default 5 s, 0 = no wait) for cascades in flight, logs what is
        abandoned, then closes every component and joins the thread.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._engine_cm.__exit__(None, None, None)
        finally:
            try:
                self._portal_cm.__exit__(None, None, None)
            finally:
                self._loop_gone = True

    def __enter__(self) -> ThreadedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_in_thread(
    config: Mapping[str, Any] | EngineConfig,
    geometry: KVGeometry | KVModel,
    device_kv: DeviceKV | None = None,
    **kwargs: Any,
) -> ThreadedEngine:
    """Start an engine on an asyncio loop in a background thread; return its blocking facade.

    ``kwargs`` are those of :func:`kvtier.open` (``events``, ``metrics``, ``wait_timeout_s``,
    ``flush_timeout_s``, ...); :meth:`ThreadedEngine.close` flushes as leaving :func:`kvtier.open` does.
    """
    try:
        config = EngineConfig.coerce(config)  # a bad configuration fails before a thread starts
    except ConfigError as exc:
        raise trim_traceback(exc)
    portal_cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
    portal = portal_cm.__enter__()
    try:
        engine_cm = portal.wrap_async_context_manager(open(config, geometry, device_kv, **kwargs))
        engine = engine_cm.__enter__()
    except BaseException as exc:
        portal_cm.__exit__(None, None, None)
        if isinstance(exc, ConfigError):
            raise trim_traceback(exc)  # not the portal's and the event loop's frames
        raise
    return ThreadedEngine(portal_cm, portal, engine_cm, engine)
