"""Deterministic fault injection against kvtier's two promises to a caller:

* **never wrong bytes** — a load that returns N tokens placed exactly the stored bytes into
  exactly the blocks of those N tokens, and touched no other block;
* **nothing stored is lost** — a chunk whose store was acknowledged (and drained, where the
  writer may die) is found again while the tier has room for it.

Every chunk's bytes derive from its token prefix (``fault_worker.chunk_payload``), so any block
a load writes can be checked exactly. Only public API is used: ``kvtier.open``, ``KVGeometry``,
``engine.store/load/drain/statistics`` (plus ``engine.manager.jobs_in_flight``), CPU tensors
as the device and a CPU + fs engine in a temporary directory.

Scenarios (each prints one ``FAULT-SUMMARY`` line, visible with ``-s``):

1. SIGKILL of a writer process at seeded random points, repeated; a fresh engine then loads every
   prompt that was ever written, and (``stale_tmp_grace_s: 0``) must leave no ``*.tmp`` behind.
2. Two processes storing overlapping prompt sets into one root and loading each other's.
3. Cancellation storms (``move_on_after`` with tiny timeouts, task groups cancelled after a
   random number of checkpoints) on asyncio and trio: no pinned slot afterwards, later
   operations work and serve the right bytes.
4. A soak of >= 10,000 operations over a working set much larger than host memory and a
   bounded fs tier: fds, threads, RSS and on-disk chunk bytes stay bounded.
5. Hypothesis: random sequences of store / load / drain / cancelled and concurrent operations.
6. :class:`~kvtier.tiers.faulty.FaultyTier` wrapped around an fs tier: injected failures fail
   exactly their chunks.

Subprocess children are forked from one "zygote" process (``tests/support/fault_worker.py zygote``,
started with ``sys.executable``) that imported torch and kvtier once: a SIGKILL round then costs
a ``fork()``, not an interpreter start. The zygote is killed and reaped at module teardown, and
every child is killed and reaped before a test returns.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import fault_worker as fw
import pytest
from fault_worker import BLOCK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import KVGeometry
from kvtier.config import TierConfig
from kvtier.host.slots import SlotBuffer
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.fs.tier import FileSystemTier

SUPPORT = Path(__file__).resolve().parents[1] / "support"

WORKER = SUPPORT / "fault_worker.py"
REPO = Path(__file__).resolve().parents[2]
#: On-disk size of one chunk file: the slot's bytes plus the 4096-byte trailer page (README).
FILE_BYTES = fw.SLOT_BYTES + 4096

SUMMARIES: list[str] = []


def summary(scenario: str, **figures: Any) -> None:
    line = "FAULT-SUMMARY " + scenario + " " + " ".join(f"{k}={v}" for k, v in figures.items())
    SUMMARIES.append(line)
    print(line)


# ------------------------------------------------------------------------------------------------
# Files under a root
# ------------------------------------------------------------------------------------------------


def walk_files(root: Path) -> Iterator[tuple[Path, int]]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            try:
                yield path, path.lstat().st_size
            except FileNotFoundError:  # removed by a worker thread mid-walk
                continue


def tmp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p, _ in walk_files(root) if p.name.endswith(".tmp"))


def chunk_bytes(root: Path) -> int:
    return sum(size for p, size in walk_files(root) if p.name.endswith(".bin"))


def litter(root: Path) -> list[str]:
    """Files that are neither chunks, nor a run's config.json, nor temporaries."""
    return sorted(
        str(p.relative_to(root)) for p, _ in walk_files(root)
        if not (p.name.endswith(".bin") or p.name == "config.json" or p.name.endswith(".tmp"))
    )


# ------------------------------------------------------------------------------------------------
# The zygote: forks the worker children, reports their pids and exit codes
# ------------------------------------------------------------------------------------------------


class Zygote:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "zygote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
        )
        self.lines: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self.live: set[str] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            tag, _, msg = raw.decode(errors="replace").rstrip("\n").partition(" ")
            self.lines.put((tag, msg))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def start(self, cmd: str, tag: str, *args: str) -> None:
        assert all(" " not in a for a in args), args
        self.live.add(tag)
        self.send(" ".join((cmd, tag, *args)))

    def kill(self, tag: str) -> None:
        self.send(f"kill {tag}")

    def poll(self, timeout: float) -> tuple[str, str] | None:
        """The next message, or None when none came within ``timeout`` seconds."""
        try:
            item = self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if item is None:
            self.lines.put(None)  # stay at end-of-stream
            raise AssertionError(f"the zygote exited unexpectedly{self.log_tail()}")
        tag, msg = item
        if msg.startswith("exit "):
            self.live.discard(tag)
        return tag, msg

    def next(self, timeout: float) -> tuple[str, str]:
        got = self.poll(timeout)
        if got is None:
            raise AssertionError(f"no message from the worker processes within {timeout:.1f}s{self.log_tail()}")
        return got

    def expect(self, tag: str, msg: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            got = self.next(max(0.01, deadline - time.monotonic()))
            if got == (tag, msg):
                return

    def reap_all(self, timeout: float = 30.0) -> None:
        """Kill every child still alive and wait until the zygote reaped it."""
        deadline = time.monotonic() + timeout
        for tag in list(self.live):
            self.kill(tag)
        while self.live and time.monotonic() < deadline:
            try:
                self.next(max(0.01, deadline - time.monotonic()))
            except AssertionError:
                break

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"\n--- worker stderr (tail) ---\n{text[-n:]}" if text else ""

    def close(self) -> None:
        try:
            self.reap_all(timeout=10)
        finally:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()  # EOF: the zygote kills and reaps its children, then exits
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                self._log.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote") / "stderr.log")
    try:
        z.expect("zygote", "ready", timeout=120)  # torch and kvtier imported
        yield z
    finally:
        z.close()


# ------------------------------------------------------------------------------------------------
# Loads checked against the stored bytes
# ------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    loads: int = 0
    full_hits: int = 0
    partial: int = 0
    misses: int = 0
    wrong_blocks: int = 0
    wrong_loads: list[str] = field(default_factory=list)

    def record(self, name: str, tokens: Sequence[int], placed: int | None, wrong: int) -> None:
        self.loads += 1
        nchunks = len(tokens) // BLOCK
        if placed is not None:
            if placed == nchunks * BLOCK:
                self.full_hits += 1
            elif placed == 0:
                self.misses += 1
            else:
                self.partial += 1
        if wrong:
            self.wrong_blocks += wrong
            if len(self.wrong_loads) < 10:
                self.wrong_loads.append(f"{name}: placed={placed} of {nchunks * BLOCK}, {wrong} wrong block(s)")


async def checked_load(engine: Any, kv: list[Any], tokens: Sequence[int], blocks: Sequence[int],
                       tally: Tally, name: str) -> int:
    fw.poison(kv, blocks)
    placed = await engine.load(tokens, blocks)
    tally.record(name, tokens, placed, fw.check_load(kv, tokens, blocks, placed))
    return placed


def leak_counts(engine: Any) -> dict[str, int]:
    """What must be zero once every operation returned and ``drain()`` did: pinned or
    write-pending host slots, manager jobs, and jobs running or queued in each tier."""
    stats = engine.statistics()
    host = stats["0:primary"]
    leaks = {"pinned_slots": host.pinned_slots, "write_pending": host.write_pending,
             "jobs_in_flight": engine.manager.jobs_in_flight}
    for tier in engine.tiers:
        t = stats[tier.context.label]
        leaks[f"{t.label}_in_flight"] = t.loads_in_flight + t.stores_in_flight + t.queued_jobs
    return leaks


def assert_no_pins(engine: Any) -> dict[str, int]:
    leaks = leak_counts(engine)
    assert not any(leaks.values()), leaks
    return leaks


def test_the_load_check_catches_every_kind_of_wrong_bytes() -> None:
    """The oracle itself: wrong chunk, stray write beyond the reported prefix, torn block, and a
    missing write inside it are all counted; the right bytes are not."""
    kv = fw.device_kv(8)
    a, b = fw.make_prompts(seed=5, n=2, systems=1, system_chunks=1, min_tail=2, max_tail=2)
    blocks = [0, 1, 2]
    fw.poison(kv, blocks)
    fw.fill_prompt(kv, a[: 2 * BLOCK], blocks)
    assert fw.check_load(kv, a, blocks, 2 * BLOCK) == 0
    assert fw.check_load(kv, a, blocks, None) == 0
    assert fw.check_load(kv, a, blocks, BLOCK) == 1  # block 1 written beyond the reported prefix
    assert fw.check_load(kv, a, blocks, 3 * BLOCK) == 1  # block 2 reported but never written
    assert fw.check_load(kv, a, blocks, 5) == 3  # not a whole number of chunks
    fw.fill_prompt(kv, b, [5, 6, 7])
    for layer in kv:
        layer[1].copy_(layer[6])  # b's second chunk where a's belongs (same system prefix, other tail)
    assert fw.check_load(kv, a, blocks, 2 * BLOCK) == 1
    assert fw.check_load(kv, a, blocks, None) == 1
    fw.fill_prompt(kv, a[: 2 * BLOCK], blocks)
    kv[1][0].view(-1)[7] += 1  # one element of one layer torn
    assert fw.check_load(kv, a, blocks, 2 * BLOCK) == 1
    assert fw.check_load(kv, a, blocks, None) == 1


# ------------------------------------------------------------------------------------------------
# 1. SIGKILL of writer processes at random points
# ------------------------------------------------------------------------------------------------

KILL_ROUNDS = 12


@dataclass
class KilledRoot:
    root: Path
    rounds: int
    kills: int  # children that died of SIGKILL
    killed_during_startup: int  # killed before the engine reported "open"
    stored: set[int]  # universe indexes whose store() returned in some round
    final: set[int]  # stored by the clean last round, which drained and exited 0
    tmp_left: list[str]  # temporaries on disk after all rounds
    litter: list[str]


@pytest.fixture(scope="module")
def killed_root(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> KilledRoot:
    root = tmp_path_factory.mktemp("killed") / "root"
    universe = fw.kill_universe()
    rng = random.Random(0x5EED)
    stored: set[int] = set()
    kills = during_startup = 0
    try:
        for r in range(KILL_ROUNDS + 1):
            last = r == KILL_ROUNDS
            order = rng.sample(range(len(universe)), 80 if last else len(universe))
            tag = f"k{r}"
            zygote.start("writer", tag, str(root), str(r), json.dumps(order, separators=(",", ":")))
            mode = rng.choice(("lines", "delay"))
            kill_after_lines = rng.randint(0, 60)
            kill_delay = rng.uniform(0.0, 0.25) if mode == "delay" else rng.uniform(0.0, 0.005)
            kill_at = math.inf
            opened = killed = False
            lines = 0
            code = None
            while code is None:
                if not killed and time.monotonic() >= kill_at:
                    zygote.kill(tag)
                    killed = True
                    during_startup += not opened
                    continue
                wait = 60.0 if killed or kill_at == math.inf else min(60.0, kill_at - time.monotonic())
                got = zygote.poll(wait)
                if got is None:
                    if killed or kill_at == math.inf:
                        raise AssertionError(f"writer round {r} went silent{zygote.log_tail()}")
                    continue  # the kill time has come
                gtag, msg = got
                if gtag != tag:
                    continue
                if msg.startswith("exit "):
                    code = int(msg.split()[1])
                elif last:
                    if msg.startswith("stored "):
                        stored.add(int(msg.split()[1]))
                elif msg.startswith("pid ") and mode == "delay":
                    kill_at = time.monotonic() + kill_delay
                elif msg == "open":
                    opened = True
                    if mode == "lines" and kill_after_lines == 0:
                        kill_at = time.monotonic() + kill_delay
                elif msg.startswith("stored "):
                    stored.add(int(msg.split()[1]))
                    lines += 1
                    if mode == "lines" and lines == kill_after_lines:
                        kill_at = time.monotonic() + kill_delay
            if last:
                assert code == 0, f"the clean writer exited with {code}{zygote.log_tail()}"
            else:
                assert code in (0, -9), f"writer round {r} exited with {code}{zygote.log_tail()}"
                kills += code == -9
        final = set(order)
    finally:
        zygote.reap_all()
    return KilledRoot(root, KILL_ROUNDS, kills, during_startup, stored, final, tmp_files(root), litter(root))


def copy_root(src: Path, dst: Path) -> Path:
    """A private copy (mtimes kept), so each backend's run sees the same killed tree."""
    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return dst


@pytest.mark.anyio
async def test_sigkilled_writers_never_serve_wrong_bytes_nor_lose_drained_chunks(
        killed_root: KilledRoot, tmp_path: Path) -> None:
    root = copy_root(killed_root.root, tmp_path / "root")
    universe = fw.kill_universe()
    kv = fw.device_kv()
    tally = Tally()
    lost_prompts: list[int] = []
    lost_chunks = died_in_host = 0
    with anyio.fail_after(120):
        async with kvtier.open(fw.fs_config(root, slots=64), fw.geometry(), kv) as engine:
            # Every prompt of the universe: written completely, partly (killed), or never.
            for i, tokens in enumerate(universe):
                blocks = list(range(len(tokens) // BLOCK))
                placed = await checked_load(engine, kv, tokens, blocks, tally, f"prompt {i}")
                if i in killed_root.final and placed != len(blocks) * BLOCK:
                    lost_prompts.append(i)
                    lost_chunks += len(blocks) - placed // BLOCK
                elif i in killed_root.stored and placed != len(blocks) * BLOCK:
                    died_in_host += 1  # acknowledged by a writer killed before its cascade: allowed
            await engine.drain()
            leaks = leak_counts(engine)
    summary("sigkill", rounds=killed_root.rounds, kills=killed_root.kills,
            killed_during_startup=killed_root.killed_during_startup,
            tmp_left_by_kills=len(killed_root.tmp_left), prompts_ever_stored=len(killed_root.stored),
            loads=tally.loads, full_hits=tally.full_hits, partial=tally.partial, misses=tally.misses,
            wrong_bytes=tally.wrong_blocks, chunks_lost=lost_chunks, acked_by_killed_not_found=died_in_host,
            litter=len(killed_root.litter), leaks=sum(leaks.values()))
    assert killed_root.kills >= KILL_ROUNDS // 2, "most rounds should have been killed mid-stream"
    assert tally.wrong_blocks == 0, tally.wrong_loads
    assert not lost_prompts, f"{lost_chunks} drained chunk(s) of prompts {lost_prompts[:10]} not found"
    assert not any(leaks.values()), leaks
    # Everything the clean round stored must come back in full (and so it did above); most of
    # the prompts ever acknowledged by killed rounds are found too, but host-only ones may die.
    assert tally.full_hits >= len(killed_root.final)


@pytest.mark.anyio
async def test_fresh_engine_removes_temporaries_of_killed_writers(killed_root: KilledRoot, tmp_path: Path) -> None:
    """``stale_tmp_grace_s: 0``: a fresh engine's start-up scan removes every crashed writer's
    temporary. Besides whatever the SIGKILLs left, plant the two temporaries a writer killed
    between ``open(O_EXCL)`` and ``rename`` leaves: a partial copy of an existing chunk and of a
    chunk that never made it."""
    root = copy_root(killed_root.root, tmp_path / "root")
    chunks = sorted(p for p, _ in walk_files(root) if p.name.endswith(".bin"))
    assert chunks, "the killed writers stored nothing"
    planted = [
        chunks[0].with_name(f"{chunks[0].name}_1234567890123.tmp"),
        chunks[-1].with_name(f"{'ab' * 32}.bin_42.tmp"),
    ]
    for path in planted:
        path.write_bytes(b"\x5a" * (fw.SLOT_BYTES // 2))
        old = time.time() - 10
        os.utime(path, (old, old))
    before = tmp_files(root)
    kv = fw.device_kv()
    config = fw.fs_config(root, slots=16, stale_tmp_grace_s=0)
    with anyio.fail_after(60):
        async with kvtier.open(config, fw.geometry(), kv) as engine:
            for tier in engine.tiers:
                await tier.wait_scanned()  # the start-up scan runs in the background
            after_start = tmp_files(root)
    summary("stale-tmp", tmp_before_start=len(before), tmp_left_by_kills=len(killed_root.tmp_left),
            planted=len(planted), tmp_after_start=len(after_start), litter=len(litter(root)))
    assert after_start == [], f"temporaries survived a start-up with stale_tmp_grace_s=0: {after_start[:10]}"


@pytest.mark.anyio
async def test_fresh_engine_removes_config_temporary_of_a_writer_killed_at_first_start(
        killed_root: KilledRoot, tmp_path: Path) -> None:
    """A writer killed during its first start, between creating ``config.json_<n>.tmp`` and
    linking it to ``config.json``, leaves that temporary next to the run's config.json; with
    ``stale_tmp_grace_s: 0`` a later start must remove it too (nothing else ever will)."""
    root = copy_root(killed_root.root, tmp_path / "root")
    configs = [p for p, _ in walk_files(root) if p.name == "config.json"]
    assert len(configs) == 1, configs
    planted = configs[0].with_name("config.json_4242424242.tmp")
    planted.write_text(configs[0].read_text()[:10])
    old = time.time() - 10
    os.utime(planted, (old, old))
    kv = fw.device_kv()
    with anyio.fail_after(60):
        async with kvtier.open(fw.fs_config(root, slots=16, stale_tmp_grace_s=0), fw.geometry(), kv) as engine:
            for tier in engine.tiers:
                await tier.wait_scanned()
            after_start = tmp_files(root)
    summary("stale-config-tmp", planted=1, tmp_after_start=len(after_start))
    assert after_start == [], f"temporaries survived a start-up with stale_tmp_grace_s=0: {after_start}"


# ------------------------------------------------------------------------------------------------
# 2. Two processes sharing a root
# ------------------------------------------------------------------------------------------------


def test_two_processes_sharing_a_root_never_serve_each_other_wrong_bytes(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "root"
    summaries: dict[str, dict[str, int]] = {}
    codes: dict[str, int] = {}
    try:
        zygote.start("peer", "pa", str(root), "a", "b", "0")
        zygote.start("peer", "pb", str(root), "b", "a", "1")
        deadline = time.monotonic() + 120
        while len(codes) < 2:
            tag, msg = zygote.next(max(0.01, deadline - time.monotonic()))
            if tag not in ("pa", "pb"):
                continue
            if msg.startswith("summary "):
                summaries[tag] = json.loads(msg[len("summary "):])
            elif msg.startswith("exit "):
                codes[tag] = int(msg.split()[1])
    finally:
        zygote.reap_all()
    total = {k: sum(s.get(k, 0) for s in summaries.values())
             for k in ("stores", "loads", "hits", "wrong", "lost_chunks", "retries", "pinned_slots")}
    summary("two-processes", **total)
    assert codes == {"pa": 0, "pb": 0}, f"exit codes {codes}, summaries {summaries}{zygote.log_tail()}"
    assert total["wrong"] == 0 and total["lost_chunks"] == 0
    assert total["hits"] == len(fw.peer_prompts(0)) + len(fw.peer_prompts(1))


# ------------------------------------------------------------------------------------------------
# 3. Cancellation storms
# ------------------------------------------------------------------------------------------------

STORM_TASKS = 120
STORM_WAVES = 3
STORM_MAX_CHUNKS = 4
TIMEOUTS = (0.0, 0.0, 1e-5, 1e-4, 5e-4, 2e-3, 1e-2, math.inf)


@pytest.mark.anyio
async def test_cancellation_storms_leave_no_pins_and_no_wrong_bytes(tmp_path: Path) -> None:
    rng = random.Random(0xCA9CE1)
    prompts = fw.make_prompts(seed=31, n=60, systems=3, system_chunks=1, max_tail=STORM_MAX_CHUNKS - 1)
    kv = fw.device_kv(STORM_TASKS * STORM_MAX_CHUNKS)
    tally = Tally()
    acked: set[int] = set()  # prompts whose store returned > 0 un-cancelled: all chunks are held
    cancelled = completed = 0
    config = fw.fs_config(tmp_path / "root", slots=40)

    async with kvtier.open(config, fw.geometry(), kv, wait_timeout_s=10) as engine:

        async def one_op(t: int, op: str, p: int, scope_timeout: float | None) -> None:
            nonlocal cancelled, completed
            tokens = prompts[p]
            blocks = list(range(t * STORM_MAX_CHUNKS, t * STORM_MAX_CHUNKS + len(tokens) // BLOCK))
            result: list[int] = []
            if op == "store":
                fw.fill_prompt(kv, tokens, blocks)
            else:
                fw.poison(kv, blocks)
            try:
                with anyio.move_on_after(math.inf if scope_timeout is None else scope_timeout):
                    if op == "store":
                        result.append(await engine.store(tokens, blocks))
                    else:
                        result.append(await engine.load(tokens, blocks))
            finally:
                # Runs even when the task group was cancelled: checks are synchronous.
                placed = result[0] if result else None
                if result:
                    completed += 1
                else:
                    cancelled += 1
                if op == "load":
                    tally.record(f"storm load {p} task {t}", tokens, placed,
                                 fw.check_load(kv, tokens, blocks, placed))
                elif placed:
                    acked.add(p)

        with anyio.fail_after(90):
            for _wave in range(STORM_WAVES):
                ops = [(t, "store" if rng.random() < 0.5 else "load", rng.randrange(len(prompts)))
                       for t in range(STORM_TASKS)]
                by_group = [rng.random() < 0.4 for _ in ops]  # cancelled with their task group
                checkpoints = rng.randint(0, 400)

                async def group_b(ops=ops, by_group=by_group, checkpoints=checkpoints) -> None:  # noqa: ANN001
                    async with anyio.create_task_group() as tg_b:
                        for (t, op, p), in_b in zip(ops, by_group):
                            if in_b:
                                tg_b.start_soon(one_op, t, op, p, None)
                        for _ in range(checkpoints):
                            await anyio.lowlevel.checkpoint()
                        tg_b.cancel_scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(group_b)
                    for (t, op, p), in_b in zip(ops, by_group):
                        if not in_b:
                            tg.start_soon(one_op, t, op, p, rng.choice(TIMEOUTS))
            await engine.drain()
            storm_leaks = leak_counts(engine)  # checked below, after the figures are printed

            # Afterwards: acknowledged prompts come back whole; every load is right or a miss.
            lost = 0
            for p, tokens in enumerate(prompts):
                placed = await checked_load(engine, kv, tokens, list(range(len(tokens) // BLOCK)), tally,
                                            f"after-storm load {p}")
                if p in acked and placed != len(tokens) // BLOCK * BLOCK:
                    lost += len(tokens) // BLOCK - placed // BLOCK
            # Later stores and loads still work.
            for p, tokens in enumerate(prompts):
                blocks = list(range(len(tokens) // BLOCK))
                fw.fill_prompt(kv, tokens, blocks)
                await engine.store(tokens, blocks)
            await engine.drain()
            not_loaded = 0
            for p, tokens in enumerate(prompts):
                placed = await checked_load(engine, kv, tokens, list(range(10, 10 + len(tokens) // BLOCK)), tally,
                                            f"final load {p}")
                not_loaded += placed != len(tokens) // BLOCK * BLOCK
            await engine.drain()
            leaks = assert_no_pins(engine)
    summary("cancel-storm", tasks=STORM_TASKS * STORM_WAVES, cancelled=cancelled, completed=completed,
            loads=tally.loads, wrong_bytes=tally.wrong_blocks, chunks_lost=lost,
            leaks_after_storm=sum(storm_leaks.values()), leaks_at_end=sum(leaks.values()))
    assert cancelled > 0 and completed > 0
    assert tally.wrong_blocks == 0, tally.wrong_loads
    assert not any(storm_leaks.values()), f"after the storm and drain(): {storm_leaks}"
    assert lost == 0, f"{lost} chunk(s) of acknowledged stores lost"
    assert not_loaded == 0, f"{not_loaded} prompt(s) not loadable after a clean store + drain"


# ------------------------------------------------------------------------------------------------
# 4. Soak: resources stay bounded
# ------------------------------------------------------------------------------------------------

SOAK_OPS = 10_000
SOAK_PHASES = 10
SOAK_WORKERS = 4
SOAK_WARMUP_PHASES = 2
SOAK_HOST_SLOTS = 16
SOAK_FS_FILES = 48
RSS_GROWTH_LIMIT = 64 << 20
TRANSIENT_FDS = 8  # chunk files held by the 4 pool workers + a rescan's directory fds
TRANSIENT_THREADS = 4  # anyio worker threads started on demand (they expire when idle)


@dataclass
class Sample:
    op: int
    drained: bool
    rss: int
    fds: int
    threads: int
    tasks: int
    disk_chunk_bytes: int
    disk_all_bytes: int


def take_sample(op: int, drained: bool, root: Path) -> Sample:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    files = list(walk_files(root))
    return Sample(
        op=op, drained=drained, rss=rss, fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(), tasks=len(os.listdir("/proc/self/task")),
        disk_chunk_bytes=sum(size for p, size in files if p.name.endswith(".bin")),
        disk_all_bytes=sum(size for _, size in files),
    )


@pytest.mark.anyio
@pytest.mark.slow
async def test_soak_keeps_fds_threads_memory_and_disk_bounded(tmp_path: Path) -> None:
    rng = random.Random(0x50A4)
    prompts = fw.make_prompts(seed=57, n=150, systems=6, system_chunks=1, max_tail=2)  # 2-3 chunks
    distinct_chunks = len({tuple(t[: (c + 1) * BLOCK]) for t in prompts for c in range(len(t) // BLOCK)})
    max_bytes = SOAK_FS_FILES * FILE_BYTES
    root = tmp_path / "root"
    # rescan_interval_s=0.5 compresses time: a server rescans every 30 s, so an hour-long run
    # goes through as many rescans (each racing the writes in flight) as this test does.
    config = fw.fs_config(root, slots=SOAK_HOST_SLOTS, max_bytes=max_bytes, rescan_interval_s=0.5)
    kv = fw.device_kv(SOAK_WORKERS * 3)
    tally = Tally()
    samples: list[Sample] = []
    ops_done = stores = 0
    per_phase = SOAK_OPS // SOAK_PHASES // SOAK_WORKERS

    async with kvtier.open(config, fw.geometry(), kv) as engine:

        async def worker(w: int, wrng: random.Random) -> None:
            nonlocal ops_done, stores
            for _ in range(per_phase):
                p = wrng.randrange(len(prompts))
                tokens = prompts[p]
                blocks = list(range(w * 3, w * 3 + len(tokens) // BLOCK))
                if wrng.random() < 0.5:
                    fw.fill_prompt(kv, tokens, blocks)
                    await engine.store(tokens, blocks)
                    stores += 1
                else:
                    await checked_load(engine, kv, tokens, blocks, tally, f"soak load {p}")
                ops_done += 1
                if ops_done % 250 == 0:
                    samples.append(take_sample(ops_done, False, root))

        with anyio.fail_after(300):
            for _phase in range(SOAK_PHASES):
                async with anyio.create_task_group() as tg:
                    for w in range(SOAK_WORKERS):
                        tg.start_soon(worker, w, random.Random(rng.getrandbits(64)))
                await engine.drain()
                samples.append(take_sample(ops_done, True, root))
            leaks = assert_no_pins(engine)
        fs_stats = engine.statistics()["1:fs"]
        accounted_vs_disk = (fs_stats.bytes_used or 0) - chunk_bytes(root)  # reported, not asserted

    warm = [s for s in samples if s.op <= SOAK_WARMUP_PHASES * SOAK_OPS // SOAK_PHASES]
    later = [s for s in samples if s.op > SOAK_WARMUP_PHASES * SOAK_OPS // SOAK_PHASES]
    base = warm[-1]  # the drained sample that ends the warm-up
    drained_over = [s for s in samples if s.drained and s.disk_chunk_bytes > max_bytes]
    undrained_over = [s for s in samples if not s.drained and s.disk_chunk_bytes > max_bytes]
    # A sample can catch I/O in flight: a pool worker holding a chunk file open, a rescan's
    # directory fds, an anyio worker thread not yet expired. A leak raises the *floor* over
    # time, so "no growth" compares floors (the last quarter of the run against the warm-up);
    # peaks only have to stay within the transient allowance of the warm-up's peak.
    tail = later[-max(1, len(later) // 4):]
    growth = {
        "fds": min(s.fds for s in tail) - min(s.fds for s in warm),
        "threads": min(s.threads for s in tail) - min(s.threads for s in warm),
        "tasks": min(s.tasks for s in tail) - min(s.tasks for s in warm),
        "rss": max(s.rss for s in later) - base.rss,
    }
    peaks = {
        "fds": max(s.fds for s in later) - max(s.fds for s in warm),
        "tasks": max(s.tasks for s in later) - max(s.tasks for s in warm),
    }
    summary("soak", ops=ops_done, stores=stores, loads=tally.loads, full_hits=tally.full_hits,
            wrong_bytes=tally.wrong_blocks, distinct_chunks=distinct_chunks, host_slots=SOAK_HOST_SLOTS,
            fs_max_files=SOAK_FS_FILES, fs_evictions=fs_stats.evictions, samples=len(samples),
            fd_growth=growth["fds"], fd_peak_growth=peaks["fds"], thread_growth=growth["threads"],
            task_growth=growth["tasks"], task_peak_growth=peaks["tasks"],
            rss_growth_kib=growth["rss"] // 1024, max_disk_chunk_bytes=max(s.disk_chunk_bytes for s in samples),
            max_bytes=max_bytes, drained_over_cap=len(drained_over), undrained_over_cap=len(undrained_over),
            accounted_minus_disk_bytes=accounted_vs_disk,
            leaks=sum(leaks.values()))
    assert ops_done >= SOAK_OPS
    assert tally.wrong_blocks == 0, tally.wrong_loads
    assert distinct_chunks > 4 * SOAK_HOST_SLOTS and distinct_chunks > 2 * SOAK_FS_FILES
    assert fs_stats.evictions > 0
    assert growth["fds"] <= 0 and peaks["fds"] <= TRANSIENT_FDS, \
        f"open fds grew after warm-up: {[(s.op, s.fds) for s in samples]}"
    assert growth["threads"] <= 0 and growth["tasks"] <= 0 and peaks["tasks"] <= TRANSIENT_THREADS, \
        f"threads grew after warm-up: {[(s.op, s.threads, s.tasks) for s in samples]}"
    assert growth["rss"] < RSS_GROWTH_LIMIT, f"RSS grew by {growth['rss'] >> 20} MiB after warm-up"
    assert not drained_over, \
        f"chunk files exceed max_bytes={max_bytes} after drain: {[(s.op, s.disk_chunk_bytes) for s in drained_over]}"
    assert not undrained_over, (
        f"chunk files exceed max_bytes={max_bytes} while jobs run: "
        f"{[(s.op, s.disk_chunk_bytes) for s in undrained_over]}"
    )


# ------------------------------------------------------------------------------------------------
# 5. Hypothesis: random operation sequences
# ------------------------------------------------------------------------------------------------

HYPO_PROMPTS = fw.make_prompts(seed=91, n=8, systems=2, system_chunks=1, max_tail=2)  # 2-3 chunks
HYPO_SLOTS = 6  # concurrent operations at most: each gets its own 3 device blocks
_prompt = st.integers(0, len(HYPO_PROMPTS) - 1)
_simple = st.one_of(st.tuples(st.just("store"), _prompt), st.tuples(st.just("load"), _prompt))
_operation = st.one_of(
    _simple,
    st.tuples(st.just("drain")),
    # one operation under a tiny move_on_after
    st.tuples(st.just("cancel"), _simple, st.sampled_from((0.0, 1e-5, 1e-4, 1e-3, 5e-3))),
    # several at once, to completion
    st.tuples(st.just("concurrent"), st.lists(_simple, min_size=2, max_size=HYPO_SLOTS)),
    # several at once, their task group cancelled after a number of checkpoints
    st.tuples(st.just("storm"), st.lists(_simple, min_size=1, max_size=HYPO_SLOTS), st.integers(0, 40)),
)

HYPO_STATS: dict[str, int] = {"examples": 0, "operations": 0, "loads": 0, "wrong": 0, "cancelled": 0}


@pytest.fixture(scope="module")
def hypothesis_report() -> Iterator[None]:
    """Prints the figures of the property test below once the module is done."""
    yield
    if HYPO_STATS["examples"]:
        summary("hypothesis", examples=HYPO_STATS["examples"], operations=HYPO_STATS["operations"],
                loads=HYPO_STATS["loads"], wrong_bytes=HYPO_STATS["wrong"], cancelled=HYPO_STATS["cancelled"])


@pytest.mark.anyio
@pytest.mark.usefixtures("hypothesis_report")
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(_operation, min_size=1, max_size=25))
async def test_random_operation_sequences_never_serve_wrong_bytes(ops: list[tuple[Any, ...]]) -> None:
    tally = Tally()
    kv = fw.device_kv((HYPO_SLOTS + 1) * 3)
    counts = {"operations": 0, "cancelled": 0}
    with tempfile.TemporaryDirectory(prefix="kvtier-hypo-") as tmp:
        # 6 host slots, 6 chunk files on disk: evictions everywhere (a bounded tier may lose chunks).
        config = fw.fs_config(Path(tmp) / "root", slots=6, max_bytes=6 * FILE_BYTES)
        async with kvtier.open(config, fw.geometry(), kv, wait_timeout_s=3) as engine:

            async def run(op: tuple[str, int], slot: int) -> None:
                """One store or load in device blocks of its own; a load's blocks are checked
                whether it returned (exact prefix) or was cancelled (each block right or untouched)."""
                kind, p = op
                tokens = HYPO_PROMPTS[p]
                blocks = list(range(slot * 3, slot * 3 + len(tokens) // BLOCK))
                result: list[int] = []
                counts["operations"] += 1
                if kind == "store":
                    fw.fill_prompt(kv, tokens, blocks)
                else:
                    fw.poison(kv, blocks)
                try:
                    if kind == "store":
                        result.append(await engine.store(tokens, blocks))
                    else:
                        result.append(await engine.load(tokens, blocks))
                finally:
                    counts["cancelled"] += not result
                    if kind == "load":
                        placed = result[0] if result else None
                        tally.record(f"load {p}", tokens, placed, fw.check_load(kv, tokens, blocks, placed))

            with anyio.fail_after(60):
                for op in ops:
                    if op[0] == "drain":
                        await engine.drain()
                    elif op[0] == "cancel":
                        with anyio.move_on_after(op[2]):
                            await run(op[1], 0)
                    elif op[0] == "concurrent":
                        async with anyio.create_task_group() as tg:
                            for slot, sub in enumerate(op[1]):
                                tg.start_soon(run, sub, slot)
                    elif op[0] == "storm":
                        async with anyio.create_task_group() as tg:
                            for slot, sub in enumerate(op[1]):
                                tg.start_soon(run, sub, slot)
                            for _ in range(op[2]):
                                await anyio.lowlevel.checkpoint()
                            tg.cancel_scope.cancel()
                    else:
                        await run(op, 0)  # type: ignore[arg-type]
                await engine.drain()
                assert_no_pins(engine)
                # Still alive: a clean store then load of one prompt comes back whole and right.
                tokens = HYPO_PROMPTS[0]
                blocks = list(range(len(tokens) // BLOCK))
                fw.fill_prompt(kv, tokens, blocks)
                await engine.store(tokens, blocks)
                final = list(range(HYPO_SLOTS * 3, HYPO_SLOTS * 3 + len(blocks)))
                placed = await checked_load(engine, kv, tokens, final, tally, "final")
                assert placed == len(blocks) * BLOCK
    HYPO_STATS["examples"] += 1
    HYPO_STATS["operations"] += counts["operations"]
    HYPO_STATS["loads"] += tally.loads
    HYPO_STATS["wrong"] += tally.wrong_blocks
    HYPO_STATS["cancelled"] += counts["cancelled"]
    assert tally.wrong_blocks == 0, tally.wrong_loads


# ------------------------------------------------------------------------------------------------
# 6. FaultyTier wraps any tier: faults injected into an fs tier
# ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_faults_injected_into_an_fs_tier_fail_only_their_chunks(tmp_path: Path) -> None:
    geometry = KVGeometry("test/model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=BLOCK)
    slot = geometry.slot_bytes(1)
    host = SlotBuffer(8, slot)
    context = TierContext(index=0, label="1:fs", slot_bytes=slot, host=host, geometry=geometry, blocks_per_chunk=1,
                          run_fields=geometry.run_fields(1, parallel_agnostic=True))
    config = TierConfig(index=0, type="fs", options={"root_dir": str(tmp_path), "n_read_threads": 2,
                                                     "n_write_threads": 2})
    fs = FileSystemTier(config, context)
    tier = FaultyTier.around(fs)
    assert (tier.batched_writes, tier.batched_reads, tier.medium) == (fs.batched_writes, fs.batched_reads, fs.medium)
    keys = [bytes([i]) * 32 for i in range(4)]
    payloads = [os.urandom(slot) for _ in keys]
    for i, payload in enumerate(payloads):
        host.view(i)[:] = payload
    tier.fail_writes_of([keys[1]], reason="no_space")
    tier.fail_reads_of([keys[2]])

    async def run(job: TransferJob) -> Any:
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
        await tier.drain()
        [result] = tier.get_finished_jobs()
        return result

    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        stored = await run(TransferJob(1, keys, [0, 1, 2, 3], False))
        assert (stored.success, stored.failure_reason) == (False, "no_space")
        for i in range(4):
            host.view(i)[:] = bytes(slot)
        loaded = await run(TransferJob(2, [keys[0], keys[2], keys[3]], [4, 5, 6], True))
        assert (loaded.success, loaded.failure_reason) == (False, "io_error")
        assert loaded.successful_keys == [keys[0], keys[3]]  # the injected read failed only its chunk
        assert bytes(host.view(4)) == payloads[0] and bytes(host.view(6)) == payloads[3]
        assert not (await run(TransferJob(3, [keys[1]], [7], True))).success  # its write never happened
        assert fs.known(keys[1]) is not True
        stats = tier.statistics()
        assert stats.failures == {("store", "no_space"): 1, ("load", "io_error"): 1, ("load", "missing"): 1}
        assert stats.tier_type == "faulty" and any(f.name.startswith("fs_") for f in stats.custom_metrics)
        await tier.aclose()
