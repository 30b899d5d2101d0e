"""Layer-wise loading: compute layer ``i`` while layer ``i + 1`` of the cached prefix is copying.

:meth:`kvtier.Engine.load_layerwise` returns a :class:`LayerwiseLoad`::

    async with engine.load_layerwise(prompt[:-1], block_ids, num_computed_tokens=hit) as layers:
        computed = hit + layers.tokens          # known on entry: the prefix that will be placed
        async for group in layers:              # LayerGroup(start, stop), in layer order
            ...                                 # compute layers group.start .. group.stop - 1

Semantics callers rely on:

* **Entering** does what :meth:`kvtier.Engine.load` does before its copy — the same code
  (:meth:`kvtier.engine.staging.LoadStager.stage`), so the same rules: the chunks, keyed with the call's extra keys
  (``cache_salt``, LoRA, ``mm_items``, ``prompt_embeds``), are looked up from
  ``num_computed_tokens`` on, promotions from secondary tiers are awaited (the prefix ends at a
  chunk whose promotion fails or does not finish within the engine's ``wait_timeout_s``),
  ``max_load_tokens`` caps it, and the host slots of the prefix are pinned. Then one
  host→device copy per group of ``layers_per_group`` layers is submitted, all at once, in layer
  order. From here :attr:`LayerwiseLoad.tokens` is final: the tokens beyond
  ``num_computed_tokens`` that the prefix adds once every group has arrived
  (:attr:`LayerwiseLoad.tokens_by_tier` per tier label), i.e. what ``load`` would return.
* **Iterating** yields every group exactly once, in layer order, as ``LayerGroup(start, stop)``
  (layers ``start <= l < stop``), once that group's bytes of the whole prefix are on the device
  for the caller's next work: copied (CPU), or on the copy stream with the caller's stream made
  to wait for them (CUDA, see "Devices"). Later groups may still be copying. With
  ``tokens == 0`` nothing is copied and every group is yielded at once, so a caller's per-layer
  loop is the same for a hit and a miss.
* **Hybrid models** (a :class:`kvtier.KVModel`): layers are numbered in model order
  (:meth:`kvtier.KVModel.layer_order`, the index in each layer name), across all KV-cache groups;
  a layer group is yielded once every KV-cache group's copy of its layers is (as above).
* **A failed copy raises** :class:`LayerwiseLoadError` from the iteration, at the first group
  that did not arrive; the groups yielded before it hold correct bytes (but see the CUDA case
  below). The caller must then
  treat the whole prefix as not loaded and recompute it (its computed count stays the
  ``num_computed_tokens`` it passed): the prefix's KV of the missing layers can only be computed
  by running the prefix through every layer. It is an exception, not a flag, so code that
  ignores it cannot go on computing on bytes that never arrived. Every later step raises again.
  With CUDA a group's copy can fail after the group was yielded (a device error): that raises
  at the next step, or when the block is left normally.
* **Leaving the block** — after the last group, on ``break``, on an exception or on cancellation
  — withdraws the group copies that have not started (:meth:`CopyEngine.cancel`), waits,
  shielded from cancellation, for the ones in flight, and only then unpins the host slots: no
  slot is reused while a copy reads it, and no copy writes the device blocks after the block is
  left. The chunks count as used (recency) only when every group arrived.
* **Devices.** With CUDA tensors each group is one job on the copy engine's stream, with its own
  event; a group is yielded as soon as its copies are issued, the caller's stream made to wait
  for that event (:meth:`CopyEngine.get_issued`), so the caller's host code — launching the
  group's kernels — runs ahead of the copies and the device keeps the order. With CPU tensors
  each group is one job of the CPU copy engine, yielded once it is copied.
* **Ordering (CUDA).** The copies wait for the caller's stream as it was at
  ``load_layerwise(...)`` (or for its ``after`` event), and as each group is yielded the caller's
  stream is made to wait for that group's copy: kernels enqueued on it after the ``async for``
  step read the group's KV (``kvtier.host.copy_engine``, "Ordering").
* **Misuse raises at once**: ``layers_per_group`` not an int >= 1 (``TypeError``/``ValueError``)
  and an engine opened without ``device_kv`` (``RuntimeError``) at the call; bad ids as for
  ``load`` (``TypeError``/``ValueError``: ids at the call, block ids on entry); entering twice,
  iterating twice, or iterating outside the ``async with`` block (``RuntimeError``); a closing or
  closed engine (:class:`kvtier.EngineClosedError`) at the call, on entry and at every step.
* While the block is open the load is in progress: ``engine.reset_cache()`` waits for it, so
  keep the block as short as the computation it overlaps.

:class:`BlockingLayerwiseLoad` is the same for ``kvtier.start_in_thread``'s blocking facade:
``with engine.load_layerwise(...) as layers: for group in layers: ...`` where each step blocks
the calling thread until the next group is yielded (as above).

A load holds what it uses of its engine, each an object of its own: the admission gate
(:class:`kvtier.engine.gate.OperationGate`), the load stager
(:class:`kvtier.engine.staging.LoadStager`) and the device copies
(:class:`kvtier.engine.copies.DeviceCopies`). ``kvtier.engine.engine`` builds it; it never
imports the engine.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.engine.copies import DeviceCopies, PendingCopy
    from kvtier.engine.gate import OperationGate
    from kvtier.engine.staging import LoadStager, StagedLoad
    from kvtier.host.copy_jobs import CopyOrder
    from kvtier.keys import RequestExtraKeys
    from kvtier.model import KVModel

__all__ = ["LayerGroup", "LayerwiseLoad", "LayerwiseLoadError", "BlockingLayerwiseLoad", "layer_groups"]

logger = logging.getLogger("kvtier.engine.layerwise")


class LayerGroup(NamedTuple):
    """Layers ``start <= layer < stop`` (``range(*group)``) of a layer-wise load."""

    start: int
    stop: int


class LayerwiseLoadError(KvtierError, RuntimeError):
    """A layer group's host→device copy failed: the caller must recompute the whole prefix.

    ``group`` is the first group that did not arrive (groups before it were yielded, with correct
    bytes) — with CUDA, possibly one already yielded while its copies ran, whose copy failed
    after (a device error): then raised at the next step, or on leaving the block normally;
    ``reason`` is the copy engine's error (``"copy_error: ..."``, ``"closed"``, ...).
    """

    def __init__(self, group: LayerGroup, reason: str | None) -> None:
        super().__init__(
            f"layer-wise load: the copy of layers {group.start}..{group.stop - 1} failed ({reason}); "
            "the prefix is not on the device: recompute all of it"
        )
        self.group = group
        self.reason = reason


def _spans(layers: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(kv_group, start, stop)`` runs of consecutive layers of one KV-cache group, in order."""
    spans: list[tuple[int, int, int]] = []
    for kv_group, layer in layers:
        if spans and spans[-1][0] == kv_group and spans[-1][2] == layer:
            spans[-1] = (kv_group, spans[-1][1], layer + 1)
        else:
            spans.append((kv_group, layer, layer + 1))
    return spans


def layer_groups(num_layers: int, layers_per_group: int) -> list[LayerGroup]:
    """The groups of ``layers_per_group`` consecutive layers (the last one may be smaller)."""
    return [LayerGroup(start, min(start + layers_per_group, num_layers))
            for start in range(0, num_layers, layers_per_group)]


def check_layers_per_group(value: Any) -> int:
    """``value`` as an int >= 1 (``TypeError`` if not an int, ``ValueError`` if below 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"layers_per_group must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"layers_per_group must be >= 1, got {value}")
    return int(value)


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    LEFT = "left"


class LayerwiseLoad:
    """One layer-wise load; an async context manager and, inside it, an async iterator.

    Built by :meth:`kvtier.Engine.load_layerwise` (arguments already checked there) from the
    engine's admission gate, load stager and device copies; see the module docstring for the
    semantics.
    """

    def __init__(
        self,
        gate: OperationGate,
        stager: LoadStager,
        copies: DeviceCopies,
        token_ids: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        params: Mapping[str, Any] | None,
        extras: RequestExtraKeys,
        *,
        model: KVModel,
        num_computed_tokens: int,
        layers_per_group: int,
        order: CopyOrder | None = None,
    ) -> None:
        self._gate = gate
        self._stager = stager
        self._device_copies = copies
        self._order = order  # the caller's, captured at load_layerwise (see the copy engine)
        self._token_ids = token_ids
        self._block_ids = block_ids
        self._params = params
        self._extras = extras
        self._num_computed = num_computed_tokens
        self.groups: list[LayerGroup] = layer_groups(model.num_layers, layers_per_group)
        self._layer_order = model.layer_order()
        #: Tokens beyond ``num_computed_tokens`` the prefix adds once every group arrived (on entry).
        self.tokens = 0
        #: ``tokens`` per tier label, as :meth:`kvtier.Engine.load_with_sources` reports them.
        self.tokens_by_tier: dict[str, int] = {}
        self._state = _State.NEW
        self._iterating = False
        self._next = 0  # index of the next group to yield
        self._failure: LayerwiseLoadError | None = None
        self._staged: StagedLoad | None = None  # set once staged; finished on leaving
        # Per layer group, once staged with a hit: one copy per KV-cache group it has layers of.
        self._group_copies: list[list[PendingCopy]] = []
        # Copies of groups yielded while they ran (CUDA), until their result is known.
        self._unconfirmed: list[tuple[LayerGroup, PendingCopy]] = []
        self._stack = contextlib.AsyncExitStack()

    # --- context manager ------------------------------------------------------------------------
    async def __aenter__(self) -> LayerwiseLoad:
        if self._state is not _State.NEW:
            raise RuntimeError("a LayerwiseLoad is entered once; call engine.load_layerwise(...) again")
        self._gate.check_open("load_layerwise")
        self._state = _State.OPEN
        try:
            await self._stack.enter_async_context(self._gate.operation())
            await self._stage()
        except BaseException:
            await self._leave()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._state is _State.OPEN:
            await self._leave()
            # A group yielded while its copies ran (CUDA) whose copy failed after the last step:
            # the caller computed on it, so leaving normally must not pass for success.
            if exc_type is None and self._failure is None and (failure := self._late_failure()) is not None:
                raise failure

    # --- iteration --------------------------------------------------------------------------------
    def __aiter__(self) -> LayerwiseLoad:
        if self._state is not _State.OPEN:
            raise RuntimeError("iterate a LayerwiseLoad inside its `async with` block")
        if self._iterating:
            raise RuntimeError("a LayerwiseLoad is iterated once; its groups were already requested")
        self._iterating = True
        return self

    async def __anext__(self) -> LayerGroup:
        group = await self.next_group()
        if group is None:
            raise StopAsyncIteration
        return group

    async def next_group(self) -> LayerGroup | None:
        """The next group once its bytes are on the device for the caller's next work: copied
        (CPU), or on kvtier's copy stream with the caller's stream made to wait for them (CUDA:
        the host runs ahead of the copies); ``None`` after the last one.

        Raises :class:`LayerwiseLoadError` if its copy failed, or if the copy of a group yielded
        while it ran failed since (and at every later call).
        """
        if self._state is not _State.OPEN:
            raise RuntimeError("iterate a LayerwiseLoad inside its `async with` block")
        self._gate.check_open("load_layerwise")
        self._raise_failure()
        if self._next >= len(self.groups):
            return None
        group = self.groups[self._next]
        if self._group_copies:
            copies = self._device_copies
            for copy in self._group_copies[self._next]:
                done = await copies.wait_issued(copy)
                if done is None:  # reported (the CPU engine reports nothing before): how did it go?
                    result = copy.result
                    assert result is not None
                    copies.count(copy)
                    if not result.success:
                        self._failure = self._failed(group, result.error)
                        raise self._failure
                    done = result.done
                else:  # still copying: its outcome is checked at the next steps and on leaving
                    self._unconfirmed.append((group, copy))
                copies.hand_over(self._order, done)  # the caller's stream waits for the group
        self._raise_failure()  # an earlier group's copy failed while this one was awaited
        self._next += 1
        return group

    def _raise_failure(self) -> None:
        """Raise the load's failure, if there is one (a group yielded while its copies ran whose
        copy failed since becomes it)."""
        if self._failure is None:
            self._failure = self._late_failure()
        if self._failure is not None:
            raise self._failure

    def _late_failure(self) -> LayerwiseLoadError | None:
        """The first group yielded while its copies ran (CUDA) whose copy failed since; groups
        whose copies are known to have succeeded are dropped from the watch."""
        still = []
        for group, copy in self._unconfirmed:
            if copy.result is None:
                still.append((group, copy))
            elif not copy.result.success:
                return self._failed(group, copy.result.error)
        self._unconfirmed = still
        return None

    @staticmethod
    def _failed(group: LayerGroup, error: str | None) -> LayerwiseLoadError:
        logger.error("layer-wise host→device copy of layers %d..%d failed: %s", group.start, group.stop - 1, error)
        return LayerwiseLoadError(group, error)

    # --- internals --------------------------------------------------------------------------------
    async def _stage(self) -> None:
        """Stage as ``load`` does (the same stager); then submit one copy per group, in layer order."""
        staged = self._staged = await self._stager.stage(
            self._token_ids, self._block_ids, self._params, self._num_computed, self._extras)
        self.tokens_by_tier = dict(staged.tokens_by_tier)
        self.tokens = staged.tokens
        if staged.hit_keys:
            copies = {copy.group: copy for copy in staged.copies if copy.slot_ids}
            for group in self.groups:
                jobs = []
                for kv_group, start, stop in _spans(self._layer_order[group.start : group.stop]):
                    if kv_group in copies:
                        part = copies[kv_group]
                        jobs.append(self._device_copies.submit(
                            "to_device", part.slot_ids, part.block_ids, self._order, layers=(start, stop),
                            group=kv_group))
                self._group_copies.append(jobs)

    async def _leave(self) -> None:
        """Withdraw copies not started, wait for the rest (shielded), then finish the staged load."""
        self._state = _State.LEFT
        copies = self._device_copies
        arrived = False
        pending = [copy for jobs in self._group_copies for copy in jobs]
        copies_done = not pending  # until then a copy may still read the pinned slots
        try:
            with anyio.CancelScope(shield=True):
                for copy in pending:
                    copies.cancel(copy)
                try:
                    # Every job is reported exactly once (also when the engine closes): this ends.
                    for copy in pending:
                        await copies.wait(copy)
                    copies_done = True
                finally:
                    for copy in pending:
                        copies.discard(copy)
            for copy in pending:
                copies.count(copy)
            arrived = bool(pending) and all(c.result is not None and c.result.success for c in pending)
        finally:
            try:
                staged = self._staged
                if staged is not None:
                    if not copies_done:
                        # The wait itself failed: keep the slots pinned (a leak), never let one be
                        # reused while a copy may still read it.
                        staged.hit_keys = []
                    self._stager.finish(staged, arrived=arrived)
            finally:
                await self._stack.aclose()


class BlockingLayerwiseLoad:
    """:class:`LayerwiseLoad` for a thread without an event loop (``kvtier.start_in_thread``).

    ``with engine.load_layerwise(...) as layers:`` enters on the engine's loop and blocks until
    staging is decided (``layers.tokens``); each step of ``for group in layers`` blocks until the
    next group is yielded (see :meth:`LayerwiseLoad.next_group`). Leaving the ``with`` block leaves the load as the async form
    does (waiting for copies in flight, unpinning). ``call(method, func, *args)`` runs ``func``
    on the engine's loop (the facade's error mapping: :class:`kvtier.EngineClosedError` once it
    is closed).
    """

    def __init__(self, load: LayerwiseLoad, call: Callable[..., Any]) -> None:
        self._load = load
        self._call = call

    @property
    def tokens(self) -> int:
        return self._load.tokens

    @property
    def tokens_by_tier(self) -> dict[str, int]:
        return dict(self._load.tokens_by_tier)

    @property
    def groups(self) -> list[LayerGroup]:
        return list(self._load.groups)

    def __enter__(self) -> BlockingLayerwiseLoad:
        self._call("load_layerwise", self._load.__aenter__)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._call("load_layerwise", self._load.__aexit__, exc_type, exc, tb)

    def __iter__(self) -> Iterator[LayerGroup]:
        self._call("load_layerwise", self._load.__aiter__)  # the async form's checks, on the loop
        return self._groups()

    def _groups(self) -> Iterator[LayerGroup]:
        while (group := self._call("load_layerwise", self._load.next_group)) is not None:
            yield group
