"""Cache-policy operation cost against cache size (LRU and ARC).

For caches of 10^4, 10^5 and 10^6 resident, evictable chunks (36-byte keys, as a sha256 offload
key), measures per policy:

* ``touch``  one resident key per call, uniformly random (worst case for LRU: one heap push each);
* ``evict``  ``evict(1, protected=())`` per call, as the host tier makes room for one chunk;
* ``insert`` ``insert`` of a new write-pending chunk followed by ``mark_evictable`` (the store
  completing), as the host tier does for every stored chunk.

Each row prints operations per second at each size; the per-op cost at the largest size over the
smallest; that growth divided by the raw baseline's growth (≈1.0 means the policy's cost grows no
faster than a bare dictionary's, whose own growth is memory-hierarchy effects of random access
over a larger working set, not algorithmic); and the per-op cost at the largest size over a raw
``OrderedDict`` baseline (``move_to_end`` / ``popitem(last=False)`` / ``od[k] =
v``) run on the same keys in the same process. Best of three rounds; the cyclic GC is paused
during timed sections so that the numbers measure the policies, not collections of the filler.

    python benchmarks/policies.py            # 10^4, 10^5, 10^6 (about a minute)
    python benchmarks/policies.py --quick    # 10^3, 10^4, 10^5
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvtier.policies import ARCPolicy, CachePolicy, LRUPolicy
from kvtier.types import ChunkStatus

OPS = ("touch", "evict", "insert")
ROUNDS = 3


def make_keys(count: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(32) + b"\x00\x00\x00\x00" for _ in range(count)]


def timed(fn: Callable[[], None]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()  # CPU time: robust to other processes on the machine
        fn()
        return time.process_time() - start
    finally:
        gc.enable()


class PolicySubject:
    """Drives a CachePolicy the way the host tier does."""

    def __init__(self, cls: type[CachePolicy], size: int, ops: int) -> None:
        self.policy = cls(size + ops)

    def fill(self, keys: list[bytes]) -> None:
        policy = self.policy
        for slot, key in enumerate(keys):
            chunk = ChunkStatus(-1, slot)
            policy.insert(key, chunk, None)
            chunk.ref_cnt = 0
            policy.mark_evictable(key)

    def touch(self, keys: list[bytes]) -> None:
        touch = self.policy.touch
        for key in keys:
            touch((key,), None)

    def evict(self, count: int) -> list[bytes]:
        evict = self.policy.evict
        victims: list[bytes] = []
        for _ in range(count):
            result = evict(1, ())
            assert result is not None
            victims.append(result[0][0])
        return victims

    def insert(self, keys: list[bytes]) -> None:
        self.fill(keys)


class RawSubject:
    """The baseline: a bare OrderedDict doing the nearest primitive operation."""

    def __init__(self, size: int, ops: int) -> None:
        self.entries: OrderedDict[bytes, Any] = OrderedDict()

    def fill(self, keys: list[bytes]) -> None:
        entries = self.entries
        for slot, key in enumerate(keys):
            entries[key] = ChunkStatus(0, slot)

    def touch(self, keys: list[bytes]) -> None:
        move = self.entries.move_to_end
        for key in keys:
            move(key)

    def evict(self, count: int) -> list[bytes]:
        pop = self.entries.popitem
        return [pop(last=False)[0] for _ in range(count)]

    def insert(self, keys: list[bytes]) -> None:
        self.fill(keys)


def measure(subject: PolicySubject | RawSubject, size: int, ops: int, rng: random.Random) -> dict[str, float]:
    """Seconds per operation (best of ROUNDS) for each op, cache kept at ``size`` chunks."""
    resident = make_keys(size, rng)
    subject.fill(resident)
    best = {op: float("inf") for op in OPS}
    for _ in range(ROUNDS):
        sample = [resident[rng.randrange(size)] for _ in range(ops)]
        best["touch"] = min(best["touch"], timed(lambda: subject.touch(sample)) / ops)
        victims: list[bytes] = []
        best["evict"] = min(best["evict"], timed(lambda: victims.extend(subject.evict(ops))) / ops)
        # Refill with fresh keys so the next round sees a cache of the same size.
        gone = set(victims)
        fresh = make_keys(ops, rng)
        best["insert"] = min(best["insert"], timed(lambda: subject.insert(fresh)) / ops)
        resident = [k for k in resident if k not in gone] + fresh
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 10^3..10^5, fewer operations")
    args = parser.parse_args(argv)
    sizes = [10**3, 10**4, 10**5] if args.quick else [10**4, 10**5, 10**6]
    ops = 5_000 if args.quick else 20_000
    rng = random.Random(0)

    results: dict[str, dict[int, dict[str, float]]] = {}
    subjects: dict[str, Callable[[int], PolicySubject | RawSubject]] = {
        "raw": lambda n: RawSubject(n, min(ops, n // 4)),
        "lru": lambda n: PolicySubject(LRUPolicy, n, min(ops, n // 4)),
        "arc": lambda n: PolicySubject(ARCPolicy, n, min(ops, n // 4)),
    }
    for name, make in subjects.items():
        results[name] = {}
        for size in sizes:
            # Never evict more than a quarter of the cache in one round.
            size_ops = min(ops, size // 4)
            results[name][size] = measure(make(size), size, size_ops, rng)
            gc.collect()

    small, large = sizes[0], sizes[-1]
    header = (
        f"{'policy':<7}{'op':<8}"
        + "".join(f"{f'ops/s @{size:.0e}':>16}" for size in sizes)
        + f"{f'cost {large:.0e}/{small:.0e}':>18}{'/ raw growth':>14}{'vs raw @' + f'{large:.0e}':>14}"
    )
    print(f"min({ops}, size/4) operations per measurement, best of {ROUNDS} rounds")
    print(header)
    print("-" * len(header))
    for name in subjects:
        for op in OPS:
            per_op = [results[name][size][op] for size in sizes]
            row = f"{name:<7}{op:<8}" + "".join(f"{1.0 / cost:>16,.0f}" for cost in per_op)
            growth = per_op[-1] / per_op[0]
            raw_growth = results["raw"][large][op] / results["raw"][small][op]
            vs_raw = per_op[-1] / results["raw"][large][op]
            print(row + f"{growth:>18.2f}{growth / raw_growth:>14.2f}{vs_raw:>14.2f}")


if __name__ == "__main__":
    main()
