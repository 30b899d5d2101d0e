"""A log line for an event that may repeat without bound: at most one per key per interval.

What a peer or a client on the network can make happen (a refused connection, a malformed
request) must not make the log grow with it: :class:`ThrottledLog` writes the first occurrence of
each key, then at most one line per ``interval_s`` that carries how many occurrences it stood for.
Counting every occurrence is the caller's job (a metric or a statistics counter): the log line is
the human's notice, the counter is the record.

Semantics callers rely on:

* **Bounded.** At most ``max_keys`` keys are remembered (the least recently logged is forgotten
  first), so a flood of distinct keys (addresses, identities) costs bounded memory; a forgotten
  key simply logs again.
* **Never blocks, never raises** beyond what ``logging`` itself does. Not thread-safe: one owner
  (an event loop, or one thread) calls it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

__all__ = ["ThrottledLog"]


class ThrottledLog:
    """``log(key, msg, *args)`` logs ``msg % args`` unless ``key`` was logged within ``interval_s``."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, *,
                 interval_s: float = 60.0, max_keys: int = 1024) -> None:
        if not interval_s > 0 or max_keys < 1:
            raise ValueError("interval_s must be positive and max_keys at least 1")
        self._logger = logger
        self._level = level
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._keys: OrderedDict[str, tuple[float, int]] = OrderedDict()  # key -> (logged at, held back)

    def __call__(self, key: str, msg: str, *args: Any) -> bool:
        """Log now, or count the occurrence for the next line of ``key``; True if a line was written."""
        now = time.monotonic()
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._keys[key] = (last[0], last[1] + 1)
            return False
        held_back = last[1] if last is not None else 0
        self._keys.pop(key, None)
        self._keys[key] = (now, 0)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        if held_back:
            msg = f"{msg} (%d more since the last such line, %.0f s ago)"
            args = (*args, held_back, now - last[0])  # type: ignore[index]
        self._logger.log(self._level, msg, *args)
        return True
