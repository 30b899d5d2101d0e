"""Specification of the p2p data plane (``kvtier/tiers/p2p/data.py``): ucxx over TCP on 127.0.0.1.

Asyncio only: ucxx's asynchronous API runs on asyncio (its progress and completion notification
are bound to an asyncio loop), so ``anyio_backend`` is fixed to ``"asyncio"`` here. The producer of
the two-process tests is ``tests/support/p2p_data_peer.py``. No GPU, no timing assertions: every deadline
below only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest
from p2p_data_peer import chunk_bytes  # noqa: E402

from kvtier.tiers.p2p.data import TOKEN_BYTES, DataPlane, DataPlaneError, Link, chunk_tag

SUPPORT = Path(__file__).resolve().parents[2] / "support"

PEER = SUPPORT / "p2p_data_peer.py"
KIB = 1024
DEADLINE_S = 20  # turns a hang into a failure; never a performance bound

# ucxx is required (see tests/conftest.py); it is not imported here: kvtier imports it first.
pytestmark = [pytest.mark.anyio, pytest.mark.ucxx]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Producer:
    """The child process running ``p2p_data_peer.py``; commands on stdin, answers on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.port = 0

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    async def answer(self, word: str) -> list[str]:
        """The next answer line starting with ``word`` (others are skipped), split in words."""
        assert self.proc.stdout is not None
        with anyio.fail_after(DEADLINE_S):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise AssertionError(f"the producer exited while we waited for {word!r}")
                words = raw.decode().split()
                if words and words[0] == word:
                    return words

    async def token(self, session: str) -> bytes:
        self.tell(f"token {session}")
        return bytes.fromhex((await self.answer("token"))[2])

    async def stats(self) -> tuple[int, int]:
        self.tell("stats")
        _, accepted, refused = await self.answer("stats")
        return int(accepted), int(refused)


@pytest.fixture
async def producer() -> AsyncIterator[Producer]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PEER), "0.5", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    peer = Producer(proc)
    try:
        peer.port = int((await peer.answer("port"))[1])
        yield peer
    finally:
        if proc.returncode is None:
            peer.tell("quit")
            try:
                with anyio.fail_after(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def consumer() -> AsyncIterator[DataPlane]:
    plane = DataPlane()
    try:
        yield plane
    finally:
        await plane.aclose()


def slots(count: int, nbytes: int) -> list[memoryview]:
    """Page-aligned, writable host slots, as the manager hands them out."""
    buffer = memoryview(mmap.mmap(-1, count * nbytes))
    return [buffer[i * nbytes:(i + 1) * nbytes] for i in range(count)]


async def collect(errors: list[DataPlaneError], operation: object, *args: object) -> None:
    try:
        await operation(*args)  # type: ignore[operator]
    except DataPlaneError as exc:
        errors.append(exc)


# -- two processes ---------------------------------------------------------------------------------


async def test_concurrent_chunks_with_distinct_tags_land_in_their_slots(
        producer: Producer, consumer: DataPlane) -> None:
    count, nbytes, round_seq = 64, 256 * KIB, 3
    link = await consumer.connect("127.0.0.1", producer.port, await producer.token("s1"), timeout=DEADLINE_S)
    dst = slots(count, nbytes)
    slot_of = {i: count - 1 - i for i in range(count)}  # chunk i goes to slot 63 - i
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            for i in range(0, count, 2):  # half the receives are posted before anything is sent ...
                tg.start_soon(link.recv, dst[slot_of[i]], chunk_tag("s1", round_seq, i))
            await anyio.wait_all_tasks_blocked()  # every receive task waits in UCX: all are posted
            producer.tell(f"send s1 {count} {nbytes} {round_seq} 0")  # all 64, in reverse order
            # ... the other half after their sends were posted: the producer posts all 64 sends at
            # once (one gather), so once the first half has arrived every send has been posted.
            while consumer.statistics().bytes_received < count // 2 * nbytes:
                await anyio.sleep(0.01)
            for i in range(1, count, 2):
                tg.start_soon(link.recv, dst[slot_of[i]], chunk_tag("s1", round_seq, i))
            await producer.answer("sent")
    for i in range(count):
        assert np.array_equal(np.frombuffer(dst[slot_of[i]], dtype=np.uint8), chunk_bytes(round_seq, i, nbytes)), i
    assert consumer.statistics().bytes_received == count * nbytes
    assert await producer.stats() == (1, 0)


async def test_endpoints_without_a_valid_token_are_closed_and_counted(
        producer: Producer, consumer: DataPlane) -> None:
    import ucxx  # type: ignore[import-untyped]

    token = await producer.token("good")
    with pytest.raises(DataPlaneError) as wrong:
        await consumer.connect("127.0.0.1", producer.port, bytes(TOKEN_BYTES), timeout=DEADLINE_S)
    assert wrong.value.reason == "refused"

    silent = await ucxx.create_endpoint("127.0.0.1", producer.port)  # presents no token at all
    try:
        with anyio.fail_after(DEADLINE_S), pytest.raises(ucxx.exceptions.UCXError):
            await silent.recv(bytearray(1))  # fails once the producer closes it (0.5 s deadline)
    finally:
        silent.abort()

    link = await consumer.connect("127.0.0.1", producer.port, token, timeout=DEADLINE_S)
    (dst,) = slots(1, 64 * KIB)
    producer.tell(f"send good 1 {64 * KIB} 0 0")
    with anyio.fail_after(DEADLINE_S):
        await link.recv(dst, chunk_tag("good", 0, 0))
    assert np.array_equal(np.frombuffer(dst, dtype=np.uint8), chunk_bytes(0, 0, 64 * KIB))
    with pytest.raises(DataPlaneError) as reused:  # a token opens one link only
        await consumer.connect("127.0.0.1", producer.port, token, timeout=DEADLINE_S)
    assert reused.value.reason == "refused"
    assert await producer.stats() == (1, 3)


async def test_killed_producer_fails_pending_receives(producer: Producer, consumer: DataPlane) -> None:
    count, nbytes = 64, 256 * KIB
    link = await consumer.connect("127.0.0.1", producer.port, await producer.token("k"), timeout=DEADLINE_S)
    dst = slots(count, nbytes)
    errors: list[DataPlaneError] = []
    with anyio.fail_after(DEADLINE_S):  # a hang fails the test
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(collect, errors, link.recv, dst[i], chunk_tag("k", 0, i))
            producer.tell(f"send k {count} {nbytes} 0 0 {count // 2}")  # half the chunks, then idle
            await producer.answer("sent")
            # The producer's sends completing does not mean this side has taken them in yet.
            while consumer.statistics().bytes_received < count // 2 * nbytes:
                await anyio.sleep(0.01)
            os.kill(producer.proc.pid, signal.SIGKILL)
    assert len(errors) == count // 2
    for i in range(count // 2):  # what arrived before the kill is intact
        assert np.array_equal(np.frombuffer(dst[i], dtype=np.uint8), chunk_bytes(0, i, nbytes)), i
    assert link.closed
    with pytest.raises(DataPlaneError):
        await link.send(dst[0], 1)


async def test_revoked_token_is_refused_and_revoking_closes_the_link(
        producer: Producer, consumer: DataPlane) -> None:
    revoked = await producer.token("r1")
    producer.tell("revoke r1")
    await producer.answer("revoked")
    with pytest.raises(DataPlaneError) as refused:
        await consumer.connect("127.0.0.1", producer.port, revoked, timeout=DEADLINE_S)
    assert refused.value.reason == "refused"

    link = await consumer.connect("127.0.0.1", producer.port, await producer.token("r2"), timeout=DEADLINE_S)
    (dst,) = slots(1, 4 * KIB)
    errors: list[DataPlaneError] = []
    with anyio.fail_after(DEADLINE_S):
        # The producer counts the link as accepted once its acknowledgement was sent: only then
        # is there a link for the revocation to close (earlier, it refuses the endpoint instead).
        while await producer.stats() != (1, 1):
            await anyio.sleep(0.01)
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, errors, link.recv, dst, 7)
            await anyio.wait_all_tasks_blocked()  # the receive is posted
            producer.tell("revoke r2")
    assert [e.reason for e in errors] == ["peer_gone"]
    assert await producer.stats() == (1, 1)


# -- one process, both ends ------------------------------------------------------------------------


@pytest.fixture
async def pair() -> AsyncIterator[tuple[DataPlane, Link, Link]]:
    """A producer plane and its accepted link, and the consumer's link, in this process."""
    plane, client = DataPlane(accept_timeout_s=0.5), DataPlane()
    try:
        port = await plane.start()
        token = plane.issue_token("local")
        consumer_link = await client.connect("127.0.0.1", port, token, timeout=DEADLINE_S)
        producer_link = await plane.accepted("local", timeout=DEADLINE_S)
        yield plane, producer_link, consumer_link
    finally:
        await client.aclose()
        await plane.aclose()


def test_chunk_tag_is_a_stable_64_bit_name() -> None:
    # Fixed values: producer and consumer compute tags independently, in any process or version.
    assert chunk_tag("req-1", 0, 0) == 0xD7B70AE2198FA472
    assert chunk_tag("req-1", 2, 5) == 0x86AD032E04932981
    tags = {chunk_tag(rid, r, i) for rid in ("a", "b", "ab") for r in range(4) for i in range(64)}
    assert len(tags) == 3 * 4 * 64
    assert all(2**63 <= tag < 2**64 for tag in tags)  # below 2**63: the plane's own messages


async def test_a_message_of_another_length_never_fills_the_slot(pair: tuple[DataPlane, Link, Link]) -> None:
    _, producer_link, consumer_link = pair
    dst, after = slots(2, 8 * KIB)
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer_link.recv, dst, 5)
            await anyio.wait_all_tasks_blocked()  # the receive of tag 5 is posted
            await producer_link.send(memoryview(b"\xff" * (4 * KIB)), 5)
            # A message sent after it on the same link arrives after it (UCX keeps the order of
            # one endpoint's messages): once this one is in, the 4 KiB message reached the consumer.
            async with anyio.create_task_group() as later:
                later.start_soon(consumer_link.recv, after, 6)
                await producer_link.send(memoryview(b"\x01" * (8 * KIB)), 6)
            assert bytes(dst) == bytes(8 * KIB)  # still waiting: the 4 KiB message did not match
            tg.cancel_scope.cancel()
    assert bytes(after) == b"\x01" * (8 * KIB)
    assert bytes(dst) == bytes(8 * KIB)
    assert consumer_link.closed  # the cancelled receive took its link down with it


async def test_cancelled_receive_closes_its_link_and_fails_the_others(pair: tuple[DataPlane, Link, Link]) -> None:
    _, _, consumer_link = pair
    a, b = slots(2, KIB)
    errors: list[DataPlaneError] = []
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, errors, consumer_link.recv, b, 2)
            async with anyio.create_task_group() as cancelled:
                cancelled.start_soon(consumer_link.recv, a, 1)
                await anyio.wait_all_tasks_blocked()  # both receives are posted and pending
                cancelled.cancel_scope.cancel()
    assert consumer_link.closed
    assert [e.reason for e in errors] == ["closed"]


async def test_aclose_unblocks_pending_receives_and_accepts(pair: tuple[DataPlane, Link, Link]) -> None:
    plane, producer_link, _ = pair
    plane.issue_token("never")
    errors: list[DataPlaneError] = []
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, errors, plane.accepted, "never", DEADLINE_S)
            tg.start_soon(collect, errors, producer_link.recv, bytearray(16), 9)
            await anyio.wait_all_tasks_blocked()  # both wait: one for its link, one in UCX
            await plane.aclose()
    assert sorted(e.reason for e in errors) == ["closed", "revoked"]
    assert plane.statistics().links_open == 0


async def test_accepted_fails_on_timeout_and_unknown_session(pair: tuple[DataPlane, Link, Link]) -> None:
    plane, _, _ = pair
    plane.issue_token("late")
    with pytest.raises(DataPlaneError) as late:
        await plane.accepted("late", timeout=0.05)
    assert late.value.reason == "timeout"
    with pytest.raises(DataPlaneError) as unknown:
        await plane.accepted("nobody", timeout=0.05)
    assert unknown.value.reason == "unknown_session"


async def test_reissuing_or_revoking_a_token_closes_the_old_link(pair: tuple[DataPlane, Link, Link]) -> None:
    plane, producer_link, _ = pair
    plane.issue_token("local")
    assert producer_link.closed
    with pytest.raises(DataPlaneError) as closed:
        await producer_link.send(memoryview(b"x"), 1)
    assert closed.value.reason == "closed"
    assert plane.revoke("local") is None  # the reissued session has no link yet
    assert plane.revoke("unknown") is None


async def test_a_malformed_token_is_a_data_plane_error(pair: tuple[DataPlane, Link, Link]) -> None:
    plane, _, _ = pair
    client = DataPlane()
    try:
        with pytest.raises(DataPlaneError) as bad:
            await client.connect("127.0.0.1", plane.port or 0, b"short", timeout=1)
        assert bad.value.reason == "bad_token"
    finally:
        await client.aclose()


def test_without_ucxx_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvtier.errors import ConfigError
    from kvtier.tiers.p2p import data

    monkeypatch.setattr(data, "_ucxx_module", None)
    monkeypatch.setitem(sys.modules, "ucxx", None)  # "not installed"
    with pytest.raises(ConfigError, match=r"kvtier\[p2p\]"):
        data._ucxx()


def test_rdma_ports_behind_the_hosts_interfaces_stay_in_ucx_devices(tmp_path: Path) -> None:
    """Confining UCX to the host's interfaces must not drop their RDMA transports (RoCE on the
    same NIC, IPoIB's ib0): the HCA ports behind an interface are named as UCX names them."""
    from kvtier.tiers.p2p.netif import rdma_ports

    (tmp_path / "net" / "ens1f0" / "device" / "infiniband" / "mlx5_0").mkdir(parents=True)
    (tmp_path / "net" / "lo").mkdir(parents=True)
    for port in ("1", "2"):
        (tmp_path / "infiniband" / "mlx5_0" / "ports" / port).mkdir(parents=True)
    assert rdma_ports(["ens1f0", "lo"], sysfs=str(tmp_path)) == ["mlx5_0:1", "mlx5_0:2"]
    assert rdma_ports(["lo"], sysfs=str(tmp_path)) == []


def test_net_devices_confines_ucx_to_the_interfaces_of_the_host() -> None:
    from kvtier.errors import ConfigError
    from kvtier.tiers.p2p.netif import net_devices

    assert net_devices("127.0.0.1") == "lo"
    assert net_devices("0.0.0.0") is None  # every device
    with pytest.raises(ConfigError, match="not an address of any network interface"):
        net_devices("192.0.2.254")  # TEST-NET-1: on no interface here
