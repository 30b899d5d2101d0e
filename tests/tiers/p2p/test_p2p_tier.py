"""The p2p tier between real processes on 127.0.0.1: ZMQ control, UCX (TCP) data.

Every peer is a separate process (``tests/support/p2p_peer.py``) running a kvtier engine with a p2p tier;
the tests drive them with JSON lines and check the bytes that reach the consumer's device blocks.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3server import free_port

SUPPORT = Path(__file__).resolve().parents[2] / "support"

pytestmark = pytest.mark.ucxx  # required: see tests/conftest.py

PEER = SUPPORT / "p2p_peer.py"
TOKENS = 64  # 16 blocks of 4 tokens: 16 chunks per prompt


class Peer:
    """One kvtier process; ``call`` sends a command and waits for its answer."""

    def __init__(self, name: str, tiers: list[dict[str, Any]], *, env: dict[str, str] | None = None,
                 **config: Any) -> None:
        self.name = name
        for attempt in range(3):
            self.port = next((t["port"] for t in tiers if t["type"] == "p2p"), None)
            if self._start(tiers, env, config) or attempt == 2:
                break
            # free_port() gave a port that something else (an outgoing connection's ephemeral
            # port) took before the peer bound it: another port, not a failed test.
            tiers = [{**t, "port": free_port()} if t["type"] == "p2p" else t for t in tiers]
        if self._ready.get("event") != "ready":
            raise AssertionError(f"{self.name} did not start ({self._ready}); stderr:\n" + "".join(self.stderr[-40:]))

    def _start(self, tiers: list[dict[str, Any]], env: dict[str, str] | None, config: dict[str, Any]) -> bool:
        """Start the process; False only when it could not bind its port (it has exited then)."""
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps({"tiers": tiers, **config})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self._answers: dict[Any, queue.Queue[dict[str, Any]]] = {}
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.stderr: list[str] = []
        self._stderr_done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self._ready = self._events.get(timeout=60)
        if self._ready.get("event") == "ready":
            return True
        self._stderr_done.wait(10)  # the process exited: let its last words arrive
        self.proc.wait(10)
        return not any("Address already in use" in line for line in self.stderr)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("@@ "):
                continue  # not ours (UCX logs to stdout)
            msg = json.loads(line[3:])
            if "event" in msg:
                self._events.put(msg)
            else:
                self._queue(msg["id"]).put(msg)
        self._events.put({"event": "eof"})

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
        self._stderr_done.set()

    def _queue(self, ident: Any) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._answers.setdefault(ident, queue.Queue())

    def send(self, op: str, **fields: Any) -> int:
        ident = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": ident, **fields}) + "\n")
        self.proc.stdin.flush()
        return ident

    def answer(self, ident: int, timeout: float = 60) -> dict[str, Any]:
        try:
            msg = self._queue(ident).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no answer within {timeout} s; stderr:\n"
                                 + "".join(self.stderr[-40:])) from None
        assert "error" not in msg, f"{self.name}: {msg['error']}\n" + "".join(self.stderr[-40:])
        return msg

    def call(self, op: str, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        return self.answer(self.send(op, **fields), timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)

    def wait_stats(self, predicate: Any, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.call("stats")
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


def diagnosis(what: str, *peers: Peer) -> str:
    """``what``, then every peer's ``stats`` answer and the tail of its stderr (for a failure message)."""
    lines = [what]
    for peer in peers:
        try:
            stats: Any = peer.call("stats", timeout=10)
        except AssertionError as exc:
            stats = f"no stats: {exc}"
        lines += [f"--- {peer.name} stats: {stats}", f"--- {peer.name} stderr:", *peer.stderr[-30:]]
    return "\n".join(line.rstrip("\n") for line in lines)


def p2p(port: int, **options: Any) -> dict[str, Any]:
    return {"type": "p2p", "host": "127.0.0.1", "port": port, **options}


def prefiller(peer: Peer, rid: str) -> dict[str, Any]:
    return {"remote_prefiller": {"kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": peer.port}}


def kv_source(peer: Peer, rid: str) -> dict[str, Any]:
    return {"remote_kv_source": {"kv_request_id": rid, "remote_host": "127.0.0.1", "remote_port": peer.port}}


def decoder(rid: str) -> dict[str, Any]:
    return {"remote_decoder": {"kv_request_id": rid}}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Peer, Peer]]:
    """A producer (p2p + memory tier) and a consumer, shared by the tests that leave them clean."""
    producer = Peer("producer", [p2p(free_port(), unbound_store_timeout_s=20),
                                 {"type": "memory", "capacity_bytes": 8 << 20}])
    consumer = Peer("consumer", [p2p(free_port(), load_timeout_s=10)])
    try:
        yield producer, consumer
    finally:
        consumer.close()
        producer.close()


def no_pins(stats: dict[str, Any]) -> bool:
    return stats["pinned_slots"] == 0 and stats["jobs_in_flight"] == 0


def test_classic_pd_store_then_fetch(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    assert producer.call("store", prompt=1, tokens=TOKENS, params=decoder("pd-1"))["stored"] == TOKENS
    got = consumer.call("load", prompt=1, tokens=TOKENS, params=prefiller(producer, "pd-1"))
    assert got["loaded"] == TOKENS and got["ok"]
    assert no_pins(producer.wait_stats(no_pins))  # every parked job finished: pins released


def test_classic_pd_fetch_arrives_before_the_store(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    load = consumer.send("load", prompt=2, tokens=TOKENS, params=prefiller(producer, "pd-2"))
    waiting = producer.wait_stats(lambda s: s["p2p"]["p2p_waiting_fetches"][""] == 1)
    assert waiting["p2p"]["p2p_waiting_fetches"][""] == 1  # the consumer's fetch waits at the producer
    assert producer.call("store", prompt=2, tokens=TOKENS, params=decoder("pd-2"))["stored"] == TOKENS
    got = consumer.answer(load)
    assert got["loaded"] == TOKENS and got["ok"]
    assert no_pins(producer.wait_stats(no_pins))


def test_prefix_hits_are_sent_too(pair: tuple[Peer, Peer]) -> None:
    """REQUEST_LEVEL: chunks the producer already held (an earlier request) are parked as well."""
    producer, consumer = pair
    producer.call("store", prompt=3, tokens=TOKENS // 2)  # an ordinary request: first half held
    assert producer.call("store", prompt=3, tokens=TOKENS, params=decoder("pd-3"))["stored"] == TOKENS // 2
    got = consumer.call("load", prompt=3, tokens=TOKENS, params=prefiller(producer, "pd-3"))
    assert got["loaded"] == TOKENS and got["ok"]


def test_several_fetches_at_once(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    second = Peer("consumer-2", [p2p(free_port(), load_timeout_s=10)])
    try:
        for i in range(4):
            stored = producer.call("store", prompt=10 + i, tokens=TOKENS, params=decoder(f"many-{i}"))
            assert stored["stored"] == TOKENS, diagnosis(f"store {i}: {stored}", producer, consumer, second)
        loads = [(c, c.send("load", prompt=10 + i, tokens=TOKENS, params=prefiller(producer, f"many-{i}")))
                 for i, c in enumerate([consumer, second, consumer, second])]
        answers = [c.answer(ident) for c, ident in loads]
        for i, got in enumerate(answers):
            assert got["loaded"] == TOKENS and got["ok"], diagnosis(f"load {i}: {answers}", producer, consumer, second)
        assert no_pins(producer.wait_stats(no_pins))
    finally:
        second.close()


def test_a_hybrid_model_moves_every_group_between_peers() -> None:
    """Full-attention, sliding-window and state chunks of one prompt go from producer to consumer;
    the consumer's device holds exactly what each group needs (``ok``)."""
    producer = Peer("producer-hybrid", [p2p(free_port())], hybrid=True)
    consumer = Peer("consumer-hybrid", [p2p(free_port(), load_timeout_s=10)], hybrid=True)
    try:
        assert producer.call("store", prompt=30, tokens=TOKENS, params=decoder("hy-1"))["stored"] == TOKENS
        got = consumer.call("load", prompt=30, tokens=TOKENS, params=prefiller(producer, "hy-1"))
        assert got["loaded"] == TOKENS and got["ok"], diagnosis(f"load: {got}", producer, consumer)
        assert no_pins(producer.wait_stats(no_pins))
    finally:
        consumer.close()
        producer.close()


def test_symmetric_sharing_promotes_from_the_producers_fs_tier(tmp_path: Path) -> None:
    producer = Peer("producer-fs", [p2p(free_port()), {"type": "fs", "root_dir": str(tmp_path / "p")}])
    consumer = Peer("consumer-fs", [p2p(free_port(), lookup_timeout_s=10)])
    try:
        assert producer.call("store", prompt=20, tokens=TOKENS)["stored"] == TOKENS  # an ordinary request
        producer.call("drop_host")  # now only the producer's fs tier holds it
        got = consumer.call("load", prompt=20, tokens=TOKENS, params=kv_source(producer, "sym-1"))
        assert got["loaded"] == TOKENS and got["ok"]
        # Unknown prefix: every probe answers MISS, nothing is loaded, nothing hangs.
        got = consumer.call("load", prompt=21, tokens=TOKENS, params=kv_source(producer, "sym-2"))
        assert got["loaded"] == 0
        assert no_pins(producer.wait_stats(no_pins))
    finally:
        consumer.close()
        producer.close()


def test_producer_killed_mid_fetch_costs_a_miss_within_load_timeout() -> None:
    producer = Peer("doomed", [p2p(free_port())])
    consumer = Peer("survivor", [p2p(free_port(), load_timeout_s=6, handshake_timeout_s=3)])
    try:
        load = consumer.send("load", prompt=30, tokens=TOKENS, params=prefiller(producer, "dead-1"))
        waiting = producer.wait_stats(lambda s: s["p2p"]["p2p_waiting_fetches"][""] == 1)
        assert waiting["p2p"]["p2p_waiting_fetches"][""] == 1  # bound, waiting for stores
        producer.kill()
        got = consumer.answer(load, timeout=30)
        assert got["loaded"] == 0
        assert got["seconds"] < 6 + 14  # load_timeout_s, with room for a busy machine: never a hang
        # The consumer still serves: its own store and load work.
        consumer.call("store", prompt=31, tokens=TOKENS)
        again = consumer.call("load", prompt=31, tokens=TOKENS)
        assert again["loaded"] == TOKENS and again["ok"]
        # And a request naming the dead producer recomputes at once (session back-off).
        quick = consumer.call("load", prompt=30, tokens=TOKENS, params=prefiller(producer, "dead-2"))
        assert quick["loaded"] == 0
    finally:
        consumer.close()
        producer.close()


def test_unfetched_stores_release_their_pins_after_unbound_store_timeout() -> None:
    producer = Peer("parker", [p2p(free_port(), unbound_store_timeout_s=1.5)])
    try:
        producer.call("store", prompt=40, tokens=TOKENS, params=decoder("never-fetched"))
        assert producer.call("stats")["pinned_slots"] > 0  # parked: pinned for the consumer
        stats = producer.wait_stats(no_pins, timeout=15)
        assert no_pins(stats)
        assert stats["p2p"]["p2p_reaped_ids"][""] == 1
    finally:
        producer.close()


def test_consumer_killed_after_binding_releases_the_producers_pins() -> None:
    producer = Peer("bound", [p2p(free_port(), unbound_store_timeout_s=60)])
    consumer = Peer("killed", [p2p(free_port())])
    try:
        consumer.send("load", prompt=41, tokens=TOKENS, params=prefiller(producer, "bound-1"))
        waiting = producer.wait_stats(lambda s: s["p2p"]["p2p_waiting_fetches"][""] == 1)
        assert waiting["p2p"]["p2p_waiting_fetches"][""] == 1  # the fetch bound the id; no store yet
        consumer.kill()
        producer.call("store", prompt=41, tokens=TOKENS // 2, params=decoder("bound-1"))
        stats = producer.wait_stats(no_pins, timeout=30)  # well before unbound_store_timeout_s
        assert no_pins(stats)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("what", "consumer_config", "env"), [
    ("hash_seed", {}, {"PYTHONHASHSEED": "12345"}),
    ("slot_bytes", {"head_dim": 128}, {}),
    ("config_fingerprint", {"model": "another/model"}, {}),
    ("config_fingerprint", {"head_dim": 16}, {}),  # same slot size after page rounding, other pages
])
def test_mismatched_peers_are_refused(what: str, consumer_config: dict[str, Any], env: dict[str, str]) -> None:
    producer = Peer("strict", [p2p(free_port())])
    consumer = Peer("mismatched", [p2p(free_port(), handshake_timeout_s=5)], env=env, **consumer_config)
    try:
        producer.call("store", prompt=50, tokens=TOKENS, params=decoder("mm-1"))
        got = consumer.call("load", prompt=50, tokens=TOKENS, params=prefiller(producer, "mm-1"))
        assert got["loaded"] == 0
        refused = producer.wait_stats(lambda s: s["p2p"]["p2p_handshakes_refused"])["p2p"]["p2p_handshakes_refused"]
        assert refused.get(what) == 1, refused
    finally:
        consumer.close()
        producer.close()


def test_curve_auth_serves_trusted_peers_and_refuses_others(tmp_path: Path) -> None:
    import zmq.auth

    ports = {"producer": free_port(), "trusted": free_port(), "stranger": free_port()}
    trusted_dir, keys = tmp_path / "trusted", tmp_path / "keys"
    trusted_dir.mkdir()
    keys.mkdir()
    for name, port in ports.items():
        public, secret = zmq.auth.create_certificates(str(keys), name)
        if name != "stranger":
            (trusted_dir / f"127.0.0.1:{port}.key").write_bytes(Path(public).read_bytes())

    def auth(name: str) -> dict[str, str]:
        return {"curve_secret_key_file": str(keys / f"{name}.key_secret"),
                "curve_public_key_file": str(keys / f"{name}.key"),
                "trusted_public_keys_dir": str(trusted_dir)}

    producer = Peer("auth-producer", [p2p(ports["producer"], auth=auth("producer"))])
    trusted = Peer("auth-trusted", [p2p(ports["trusted"], auth=auth("trusted"))])
    stranger = Peer("auth-stranger", [p2p(ports["stranger"], auth=auth("stranger"), handshake_timeout_s=3)])
    try:
        producer.call("store", prompt=60, tokens=TOKENS, params=decoder("auth-1"))
        got = trusted.call("load", prompt=60, tokens=TOKENS, params=prefiller(producer, "auth-1"))
        assert got["loaded"] == TOKENS and got["ok"]
        producer.call("store", prompt=61, tokens=TOKENS, params=decoder("auth-2"))
        got = stranger.call("load", prompt=61, tokens=TOKENS, params=prefiller(producer, "auth-2"))
        assert got["loaded"] == 0
    finally:
        for peer in (stranger, trusted, producer):
            peer.close()


def test_out_of_order_and_malformed_messages_do_not_disturb_serving(pair: tuple[Peer, Peer]) -> None:
    """A raw DEALER speaks out of turn at the producer: rejected and counted, nothing pinned, and
    the next consumer is served as usual."""
    import zmq

    from kvtier.tiers.p2p import protocol as p

    producer, consumer = pair
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, f"127.0.0.1:{free_port()}".encode())
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"tcp://127.0.0.1:{producer.port}")
    try:
        key = bytes(36)
        rogue.send(p.encode(p.Fetch(kv_request_id="x", keys=[key], block_indexes=[0], round_seq=0)))  # no handshake
        rogue.send(p.encode(p.Lookup(kv_request_id="x", keys=[key], round_seq=0)))
        rogue.send(b"\x81\xa4type\xa7nonsense")  # an unknown message type
        rogue.send(b"\xff" * 100)  # not msgpack at all
        stats = producer.wait_stats(lambda s: sum(s["p2p"]["p2p_messages_rejected"].values()) >= 4)
        rejected = stats["p2p"]["p2p_messages_rejected"]
        assert rejected.get("out_of_order", 0) >= 2 and sum(rejected.values()) >= 4, rejected
        assert no_pins(stats)
    finally:
        rogue.close()
        ctx.term()
    producer.call("store", prompt=70, tokens=TOKENS, params=decoder("after-rogue"))
    got = consumer.call("load", prompt=70, tokens=TOKENS, params=prefiller(producer, "after-rogue"))
    assert got["loaded"] == TOKENS and got["ok"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_p2p_tier_refuses_trio(anyio_backend: str) -> None:
    """ucxx needs asyncio: under trio, opening an engine with a p2p tier is a clear ConfigError."""
    import kvtier
    from kvtier import KVGeometry

    geometry = KVGeometry("m", num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_size=16)
    config = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * geometry.slot_bytes(1),
              "secondary_tiers": [p2p(free_port())]}
    with pytest.raises(kvtier.ConfigError, match="requires the asyncio"):
        async with kvtier.open(config, geometry):
            pass


def test_a_bound_fetch_outlives_the_unbound_timeout_while_stores_trickle_in() -> None:
    """The timeout is for stores nobody asked for: once a fetch bound the id, slow stores still
    reach it (the bound id must not be reaped under the waiting fetch)."""
    producer = Peer("slow-producer", [p2p(free_port(), unbound_store_timeout_s=1)])
    consumer = Peer("patient", [p2p(free_port(), load_timeout_s=20)])
    try:
        producer.call("store", prompt=80, tokens=TOKENS // 2, params=decoder("split"))
        load = consumer.send("load", prompt=80, tokens=TOKENS, params=prefiller(producer, "split"))
        waiting = producer.wait_stats(lambda s: s["p2p"]["p2p_waiting_fetches"][""] == 1)
        assert waiting["p2p"]["p2p_waiting_fetches"][""] == 1
        # A witness parked after the fetch bound "split", and never fetched: once it is reaped,
        # "split" has been waiting past unbound_store_timeout_s too.
        producer.call("store", prompt=81, tokens=TOKENS, params=decoder("witness"))
        reaped = producer.wait_stats(lambda s: s["p2p"]["p2p_reaped_ids"].get("", 0) >= 1)
        assert reaped["p2p"]["p2p_reaped_ids"].get("", 0) == 1  # the witness, not "split"
        assert reaped["p2p"]["p2p_waiting_fetches"][""] == 1
        producer.call("store", prompt=80, tokens=TOKENS, params=decoder("split"))
        got = consumer.answer(load)
        assert got["loaded"] == TOKENS and got["ok"]
        assert no_pins(producer.wait_stats(no_pins))
    finally:
        consumer.close()
        producer.close()


def test_both_directions_between_two_peers_are_independent() -> None:
    """A consumes from B and serves B over the same pair of sockets; A's idle consumer session
    being closed must not cut B's session with A."""
    a = Peer("a", [p2p(free_port(), idle_timeout_s=1, max_peers=1)])
    b = Peer("b", [p2p(free_port())])
    try:
        b.call("store", prompt=90, tokens=TOKENS, params=decoder("b-1"))
        assert a.call("load", prompt=90, tokens=TOKENS, params=prefiller(b, "b-1"))["ok"]
        a.call("store", prompt=91, tokens=TOKENS, params=decoder("a-1"))
        assert b.call("load", prompt=91, tokens=TOKENS, params=prefiller(a, "a-1"))["ok"]
        # a's consumer session to b, idle past idle_timeout_s, is closed (a holds at most one).
        idle = a.wait_stats(lambda s: s["p2p"]["p2p_peers"]["consumer"] == 0)
        assert idle["p2p"]["p2p_peers"]["consumer"] == 0
        for i in range(3):
            a.call("store", prompt=92 + i, tokens=TOKENS, params=decoder(f"a-{2 + i}"))
            got = b.call("load", prompt=92 + i, tokens=TOKENS, params=prefiller(a, f"a-{2 + i}"))
            assert got["loaded"] == TOKENS and got["ok"], i
    finally:
        b.close()
        a.close()
