"""Warm-up: promoting a prefix held by secondary tiers into host memory before its request comes.

:meth:`kvtier.Engine.prefetch` checks its arguments (:func:`check_tiers`, :func:`check_deadline`)
and runs :meth:`Prefetcher.prefetch`. Semantics callers rely on:

* The prefix is looked up as a load from token 0 looks it up — host memory first, then each
  secondary tier the request's ``kv_load_tiers`` and the call's ``tiers`` both allow, up to
  ``max_load_tokens`` — and the hit every KV-cache group can serve is resolved as for a load
  (``kvtier.engine.groups``): exactly the chunks a load would need are promoted (a sliding
  window's chunks before the hit and a state group's state at the hit, nothing else).
* Promotions go through the manager's lookups, so a prefetch and a load of the same prefix share
  one promotion per chunk, whichever asks first; no device block is touched and nothing is pinned
  once the call returns.
* Host capacity bounds it: a pass over the prefix starts at most as many promotions as there are
  free host slots (``evict=False``) or free plus evictable slots, less the prefix's own chunks
  already held (``evict=True``: the host tier's policy evicts unpinned chunks, never one a
  request pins), prefix first. A chunk beyond the budget ends the prefix, as a miss would.
* The call waits for its promotions and the tiers' probes until its deadline; chunks still being
  written then keep promoting in the background (``pending``) and ``timed_out`` is set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.config import RequestParams, TierFilter
from kvtier.config.request import TierMatcher, parse_matcher
from kvtier.engine.groups import GroupKeys, load_chunks, resolve_hit
from kvtier.manager import PRIMARY_LABEL
from kvtier.types import LookupResult

if TYPE_CHECKING:
    from kvtier.engine.event_relay import EventRelay
    from kvtier.engine.keying import RequestKeying
    from kvtier.engine.prefetch_tracker import PrefetchTracker
    from kvtier.engine.progress import Progress
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager
    from kvtier.tiers.base import SecondaryTier

__all__ = ["PrefetchOutcome", "Prefetcher", "check_tiers", "check_deadline"]

_ROLE_KEYS = ("remote_decoder", "remote_prefiller", "remote_kv_source")


@dataclass(frozen=True, slots=True)
class PrefetchOutcome:
    """What :meth:`kvtier.Engine.prefetch` achieved by its return.

    ``tokens``: prompt tokens a load from token 0 could place from host memory now (the hit every
    KV-cache group serves from ready chunks). ``chunks_by_tier``: the chunks that hit needs, and
    any others this call promoted that are ready, by where they came from: the label of the tier
    this call promoted them from, ``"0:primary"`` for chunks host memory already held (or another
    request brought). ``pending``: chunks the call waited for that are still being written into
    host memory at its deadline; they keep coming in the background. ``timed_out``: the deadline
    passed while a promotion or a tier's probe was still outstanding.
    """

    tokens: int
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    pending: int = 0
    timed_out: bool = False


def check_deadline(value: Any, default: float) -> float:
    """``deadline_s``: ``None`` (``default``) or a finite number of seconds > 0."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"deadline_s must be a number of seconds > 0, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"deadline_s must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_tiers(value: Any, tiers: Sequence[SecondaryTier]) -> TierFilter | None:
    """``tiers``: ``None`` (every tier) or a list in ``kv_load_tiers``' format, checked strictly.

    Entries are a tier's 0-based index, its type name or label (``"1:fs"``, any case), or a
    ``{"medium", "locality"}`` matcher. Unlike ``kv_load_tiers`` (a request's field: bad entries
    are logged and skipped) a bad entry is an error, as is an index or name that matches none of
    this engine's tiers: ``TypeError``/``ValueError`` naming the entry. ``[]`` allows no tier.
    """
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"tiers must be a list of tier indexes, names or {{medium, locality}} dicts, "
                        f"got {type(value).__name__}")
    names = {t.config.type.lower() for t in tiers} | {t.context.label.lower() for t in tiers}
    known = ", ".join(t.context.label for t in tiers) or "none"
    indexes: set[int] = set()
    chosen: set[str] = set()
    matchers: list[TierMatcher] = []
    for i, entry in enumerate(value):
        where = f"tiers[{i}]"
        if isinstance(entry, bool):
            raise TypeError(f"{where} = {entry!r}: a boolean is not a tier index")
        if isinstance(entry, int):
            if not 0 <= entry < len(tiers):
                raise ValueError(f"{where} = {entry}: no such tier index (this engine's tiers: {known})")
            indexes.add(entry)
        elif isinstance(entry, str):
            if entry.lower() not in names:
                raise ValueError(f"{where} = {entry!r} names no tier of this engine (its tiers: {known})")
            chosen.add(entry.lower())
        elif isinstance(entry, Mapping):
            matchers.append(_matcher(entry, where))
        else:
            raise TypeError(f"{where} = {entry!r}: expected an int, a string or a {{medium, locality}} dict")
    return TierFilter(frozenset(indexes), frozenset(chosen), tuple(matchers))


def _matcher(entry: Mapping[Any, Any], where: str) -> TierMatcher:
    matcher, problem = parse_matcher(entry)
    if matcher is None:
        raise ValueError(f"{where}: {problem}")
    return matcher


class Prefetcher:
    """Runs the prefetches of one engine (module docstring); loop thread only."""

    def __init__(self, manager: TieringManager, keying: RequestKeying, relay: EventRelay, progress: Progress,
                 tracker: PrefetchTracker) -> None:
        self.manager = manager
        self.host = manager.host
        self.keying = keying
        self.relay = relay
        self.progress = progress
        self.tracker = tracker

    async def prefetch(self, token_ids: Sequence[int], params: Mapping[str, Any] | None,
                       extras: RequestExtraKeys, deadline_s: float, evict: bool) -> PrefetchOutcome:
        """Promote the prefix of ``token_ids`` into host memory (module docstring); ``params`` are
        the request fields :meth:`request_fields` gave."""
        keying = self.keying
        groups = keying.groups(keying.hashes(token_ids, extras))
        ctx = keying.context("prefetch", params)
        for group in groups:
            keying.place(ctx, group.keys, 0, group.index)
        limit = ctx.params.max_load_tokens
        bound = len(token_ids) if limit is None else min(len(token_ids), limit)
        before = self._ready_hit(groups, bound)
        manager = self.manager
        host = self.host
        manager.on_new_request(ctx)
        promoted: dict[bytes, str] = {}  # this call's promotions: key -> source label
        scanned: list[bytes] = []  # keys the last pass looked up
        room = 0

        def verdict(key: bytes) -> LookupResult:
            nonlocal room
            scanned.append(key)
            held = host.lookup(key)
            if held is not LookupResult.MISS:
                if held is LookupResult.HIT and evict:
                    room -= 1  # one of the evictable slots the budget counted holds this prefix
                return manager.lookup(key, ctx)
            if room <= 0:
                return LookupResult.MISS  # beyond what host memory may take: the prefix ends here
            result = manager.lookup(key, ctx)
            if result is LookupResult.HIT_PENDING:  # a promotion this call started
                room -= 1
                label = promoted[key] = manager.get_load_source(key, ctx)
                self.tracker.promoting(key, label)
            return result

        timed_out = False
        try:
            deadline = anyio.current_time() + deadline_s
            while True:
                since = self.progress.mark()  # before the lookups: their promotions may finish at once
                manager.poll()  # settle finished jobs now, so the pass sees one state of host memory
                stats = host.statistics()
                room = stats.num_slots - stats.used_slots + (stats.evictable if evict else 0)
                scanned.clear()
                _, waiting = resolve_hit(groups, bound, 0, verdict)
                if not waiting:
                    break
                manager.on_schedule_end()  # submit the promotions this pass started
                if not await self.progress.wait(deadline, since):
                    manager.on_schedule_end()
                    timed_out = True
                    break
                self.progress.step()
            tokens = self._ready_hit(groups, bound)
            pending = sum(host.lookup(key) is LookupResult.HIT_PENDING for key in set(scanned))
            return PrefetchOutcome(tokens, self._sources(groups, tokens, promoted), pending, timed_out)
        finally:
            manager.on_request_finished(ctx)
            self.tracker.counted_request(self._ready_hit(groups, bound) - before)
            self.relay.publish()

    def request_fields(self, params: Mapping[str, Any] | None, tiers: TierFilter | None) -> Mapping[str, Any] | None:
        """The request fields a prefetch's lookups use: ``params``, with ``kv_load_tiers`` narrowed to
        the tiers ``tiers`` also allows (as the indexes of the tiers both allow). Parsing ``params``
        here raises :class:`kvtier.RequestError` for forbidden role keys, as a load would."""
        if tiers is None:
            return params
        base = RequestParams.from_kv_transfer_params(params)
        allowed = [
            i for i, tier in enumerate(self.manager.tiers)
            if all(f.allows(i, tier.config.type, tier.medium, tier.config.locality) for f in (base.load_tier_filter, tiers))
        ]
        # Rebuilt from the validated fields, so a bad value is not reported twice.
        fields: dict[str, Any] = {"kv_load_tiers": allowed}
        if base.max_load_tokens is not None:
            fields["max_load_tokens"] = base.max_load_tokens
        for role in _ROLE_KEYS:
            value = getattr(base, role)
            if value is not None:
                fields[role] = dict(value)
        return fields

    def _ready_hit(self, groups: Sequence[GroupKeys], bound: int) -> int:
        """The hit a load from token 0 could place from ready host chunks now (nothing started)."""
        lookup = self.host.lookup
        return resolve_hit(groups, bound, 0, lambda key: LookupResult.HIT if lookup(key) is LookupResult.HIT
                           else LookupResult.MISS)[0]

    def _sources(self, groups: Sequence[GroupKeys], tokens: int, promoted: Mapping[bytes, str]) -> dict[str, int]:
        """Chunks the hit ``tokens`` needs and this call's ready promotions, by source label."""
        keys = {group.keys[i]: None for group in groups for i in load_chunks(group.group, group.chunk_tokens, tokens, 0)}
        keys.update(dict.fromkeys(k for k in promoted if self.host.lookup(k) is LookupResult.HIT))
        out: dict[str, int] = {}
        for key in keys:
            label = promoted.get(key, PRIMARY_LABEL)
            out[label] = out.get(label, 0) + 1
        return out
