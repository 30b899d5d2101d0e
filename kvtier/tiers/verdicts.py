"""``VerdictCache``: what a tier last learnt about whether it holds a key.

Semantics callers rely on:

* A positive verdict holds until it is replaced (a later store, a failed load, a removal); a
  negative one expires ``negative_ttl_s`` after it was set, so chunks another process writes
  are found later.
* Newer facts win over older probes: a probe's answer is recorded only for keys with no verdict
  set after the probe was sent (:meth:`epoch` at send time, passed back as ``probe_epoch``).
* The cache is bounded: beyond ``capacity`` keys the least recently used verdict is dropped.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["VerdictCache"]


@dataclass(slots=True)
class _Verdict:
    present: bool
    expires_at: float  # math.inf for positive verdicts
    epoch: int  # when it was set; newer facts win over older probes


class VerdictCache:
    """An LRU of ``key -> present`` verdicts with expiring negatives (see the module docstring).

    ``clock`` (default ``time.monotonic``) measures expiry; tests may replace it.
    """

    def __init__(self, capacity: int, negative_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self._verdicts: OrderedDict[bytes, _Verdict] = OrderedDict()
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """A stamp that grows with every verdict set; a probe carries the one current at its send."""
        return self._epoch

    def get(self, key: bytes) -> bool | None:
        """The unexpired verdict of ``key`` (refreshing its recency), or None."""
        verdict = self._verdicts.get(key)
        if verdict is None:
            return None
        if verdict.expires_at > self.clock():
            self._verdicts.move_to_end(key)
            return verdict.present
        del self._verdicts[key]
        return None

    def set(self, keys: Iterable[bytes], present: bool, *, probe_epoch: int | None = None) -> None:
        """Record ``present`` for ``keys``; with ``probe_epoch``, only where nothing newer is known."""
        expires = math.inf if present else self.clock() + self.negative_ttl_s
        for key in keys:
            current = self._verdicts.get(key)
            if probe_epoch is not None and current is not None and current.epoch > probe_epoch:
                continue  # a store or failed load since the probe was sent knows better
            self._epoch += 1
            self._verdicts[key] = _Verdict(present, expires, self._epoch)
            self._verdicts.move_to_end(key)
        while len(self._verdicts) > self.capacity:
            self._verdicts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._verdicts)
