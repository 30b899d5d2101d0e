"""A stand-in engine for the warm-up endpoint's tests (server and ``kvtier warm``), and a server on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from kvtier.engine.warm_server import WarmupServer, warmup_options


@dataclass
class Outcome:
    """What ``Engine.prefetch`` reports (the fields the warm-up endpoint reads)."""

    tokens: int
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    pending: int = 0
    timed_out: bool = False


class FakeEngine:
    """Records each prefetch call; ``behaviour(call)`` (when given) makes its outcome or raises,
    and ``gate`` (when set) holds every call until it is set."""

    def __init__(self, behaviour: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.gate: anyio.Event | None = None
        self.entered = 0
        self.behaviour = behaviour

    async def prefetch(self, token_ids: Any, params: Any = None, **kwargs: Any) -> Outcome:
        call = {"token_ids": list(token_ids), "params": params, **kwargs}
        self.calls.append(call)
        self.entered += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.behaviour is not None:
            return self.behaviour(call)  # type: ignore[no-any-return]
        return Outcome(tokens=len(token_ids) // 4 * 4, chunks_by_tier={"1:memory": len(token_ids) // 4})


@asynccontextmanager
async def serving(engine: Any, **options: Any) -> AsyncIterator[WarmupServer]:
    """A warm-up server for ``engine`` on a free port, running until the block ends."""
    server = WarmupServer(engine, warmup_options({"port": 0, **options}))
    async with anyio.create_task_group() as tg:
        await tg.start(server.run)
        try:
            yield server
        finally:
            await server.aclose()
