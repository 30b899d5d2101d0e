"""Every program in ``examples/`` runs to completion and prints what it promises.

Each example runs as a subprocess of ``sys.executable`` with ``PYTHONPATH`` set to the
repository root (so ``import kvtier`` works without installing) and a timeout. A new example
file fails :func:`test_every_example_has_an_expectation` until it is listed in ``EXPECTED``.
The classes the examples define for embedders to copy (the FIFO policy, the zlib tier, the HTTP
parsing of the server) are also checked directly, in process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
TIMEOUT_S = 60

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the examples' modules are importable as plugins, as they say

import custom_policy  # noqa: E402
import custom_tier  # noqa: E402
import embed_async_server as server_example  # noqa: E402

from kvtier.config import TierConfig  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.tiers.base import ChunkNotFound, TierContext  # noqa: E402
from kvtier.types import ChunkStatus  # noqa: E402

#: example file -> (arguments, lines that must appear in its output). One run per entry.
EXPECTED: dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "cpu_only.py": [((), (
        "kvtier.open: stored 96 tokens, loaded 96 of 101 into other blocks; contents match: True",
        "start_in_thread: stored 96 tokens, loaded 96 of 101 into other blocks; contents match: True",
        "cpu_only: all round trips byte-identical",
    ))],
    "custom_policy.py": [((), (
        "policy in use: FIFOPolicy (from custom_policy)",
        "evicted chunk",
        "still cached: B C D E",
        "policy in use: LRUPolicy (from kvtier.policies.lru)",
        "still cached: A C D E",
        "custom_policy: FIFO evicted the oldest chunk although it was just read; LRU kept it",
    ))],
    "custom_tier.py": [((), (
        "tier 1:ZlibMemoryTier: ZlibMemoryTier from custom_tier",
        # how many come from host vs tier depends on cascade timing; all 12 must come back intact
        "loaded all 12 prompts back",
        "bytes identical: True",
        "custom_tier: promotions from the out-of-tree tier were byte-identical",
    ))],
    # Run plainly, as the README lists it, the server answers its demo requests and exits.
    "embed_async_server.py": [
        (args, (
            f"({backend})",
            "cold prompt: 199 tokens -> cached 0, computed 199",
            "same prompt again: 199 tokens -> cached 192, computed 7",
            "shared prefix: 210 tokens -> cached 160, computed 50",
            "kv correct: True",
            "1 MiB + 1 body: 413",
            "demo passed",
        ))
        for args, backend in (((), "asyncio"), (("--backend", "trio"), "trio"))
    ],
    "fs_tier.py": [((), (
        "writer: offloaded 192 tokens (12 chunks)",
        "reader: loaded 192 of 192 prompt tokens from disk; contents match: True",
    ))],
    "hybrid_model.py": [((), (
        "loaded 96 of 101 prompt tokens (58368 bytes copied to the device)",
        "group 1 (sliding_window, layers layers.1.attn): token blocks [4, 5] loaded, [0, 1, 2, 3, 6] untouched",
        "group 2 (mamba, layers layers.2.mixer): token blocks [5] loaded, [0, 1, 2, 3, 4, 6] untouched",
        "hybrid_model: every group got exactly what a load at the hit needs, byte-identical",
    ))],
    "obj_tier.py": [((), (
        "started a local S3 server (moto)",
        "engine A stored 96 tokens (6 chunks)",
        "engine B loaded 96 tokens, by tier {'1:obj': 96}; bytes identical: True",
    ))],
    "p2p_tier.py": [((), (
        "prefill: stored 128 tokens for example-request-1, parked for the decoder",
        "decode: loaded 128 of 128 tokens from the prefill process; contents match: True",
        "p2p_tier: the decode process got the prefill process's KV",
    ))],
}

RUNS = [
    pytest.param(name, args, lines, id=" ".join((name, *args)))
    for name, runs in sorted(EXPECTED.items())
    for args, lines in runs
]


def example_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_example(name: str, args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd, env=example_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )


def test_every_example_has_an_expectation() -> None:
    found = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert found == sorted(EXPECTED), "list every example in EXPECTED (and only existing ones)"


@pytest.mark.parametrize(("name", "args", "lines"), RUNS)
def test_example_runs_and_prints_its_results(name: str, args: tuple[str, ...], lines: tuple[str, ...],
                                            tmp_path: Path) -> None:
    result = run_example(name, args, tmp_path)
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    for line in lines:
        assert line in result.stdout, f"missing {line!r}\n{report}"


@pytest.mark.parametrize(("signum", "backend"), [(signal.SIGINT, "asyncio"), (signal.SIGTERM, "trio")])
def test_server_serves_http_until_interrupted(tmp_path: Path, signum: signal.Signals, backend: str) -> None:
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "embed_async_server.py"), "--serve", "--port", "0", "--backend", backend],
        cwd=tmp_path, env=example_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()  # "listening on http://127.0.0.1:PORT (asyncio)"
        assert banner.startswith("listening on http://127.0.0.1:"), banner
        url = banner.split()[2]
        tokens = list(range(100, 140))
        replies = []
        for _ in range(2):
            request = urllib.request.Request(f"{url}/prefill", data=json.dumps({"tokens": tokens}).encode(),
                                             method="POST", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                replies.append(json.loads(response.read()))
        assert [r["cached_tokens"] for r in replies] == [0, 32]
        assert replies[0]["kv_digest"] == replies[1]["kv_digest"]
        with urllib.request.urlopen(f"{url}/stats", timeout=10) as response:
            stats = json.loads(response.read())
        assert stats["requests"] == 2 and stats["cached_tokens"] == 32
        process.send_signal(signum)
        out, err = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode == 0, err
        assert f"{signum.name}: shutting down" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_server_port_without_serve_is_a_usage_error(tmp_path: Path) -> None:
    result = run_example("embed_async_server.py", ("--port", "8080"), tmp_path)
    assert result.returncode == 2 and "--serve" in result.stderr, result.stderr


def test_p2p_example_without_ucxx_says_which_extra_to_install(tmp_path: Path) -> None:
    # A ucxx that fails to import, as on a machine without the p2p extra (or without libucx).
    blocked = tmp_path / "blocked" / "ucxx"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("No module named \'ucxx\'")\n')
    env = example_env()
    env["PYTHONPATH"] = os.pathsep.join((str(blocked.parent), env["PYTHONPATH"]))
    result = subprocess.run([sys.executable, str(EXAMPLES / "p2p_tier.py")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    assert "pip install 'kvtier[p2p]'" in output and "ucxx" in output, output


# --- custom_policy.FIFOPolicy ------------------------------------------------------------------------
def test_fifo_policy_evicts_in_insertion_order_whatever_was_touched() -> None:
    policy = custom_policy.FIFOPolicy(4)
    for i, key in enumerate((b"a", b"b", b"c")):
        policy.insert(key, ChunkStatus(0, i), None)
    policy.touch([b"a"], None)
    policy.on_request_finished([[b"a"]], (), (b"a",), None)
    victims = policy.evict(2, ())
    assert victims is not None and [key for key, _ in victims] == [b"a", b"b"]
    assert len(policy) == 1 and b"c" in policy


def test_fifo_policy_evict_is_atomic_and_skips_pinned_pending_and_protected() -> None:
    policy = custom_policy.FIFOPolicy(4)
    statuses = {b"pinned": ChunkStatus(2, 0), b"pending": ChunkStatus(-1, 1),
                b"protected": ChunkStatus(0, 2), b"ready": ChunkStatus(0, 3)}
    for key, status in statuses.items():
        policy.insert(key, status, None)
    assert policy.evict(2, {b"protected"}) is None
    assert len(policy) == 4  # nothing was removed by the failed call
    assert policy.evict(1, {b"protected"}) == [(b"ready", statuses[b"ready"])]
    statuses[b"pinned"].ref_cnt = 0  # the host tier released it
    assert policy.evict(1, {b"protected"}) == [(b"pinned", statuses[b"pinned"])]
    assert policy.evict(0, ()) == []


# --- custom_tier.ZlibMemoryTier -----------------------------------------------------------------------
SLOT = 4096


def zlib_tier(**options: object) -> custom_tier.ZlibMemoryTier:
    config = TierConfig.from_dict({"type": "ZlibMemoryTier", "module_path": "custom_tier", **options}, 0)
    context = TierContext(index=0, label="1:ZlibMemoryTier", slot_bytes=SLOT, host=None, geometry=None,
                          blocks_per_chunk=1, run_fields={})
    return custom_tier.ZlibMemoryTier(config, context)


def test_zlib_tier_validates_its_options() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        zlib_tier()
    with pytest.raises(ConfigError, match="level"):
        zlib_tier(capacity_bytes=1 << 20, level=10)
    with pytest.raises(ConfigError, match="unknown key"):
        zlib_tier(capacity_bytes=1 << 20, colour="blue")


@pytest.mark.anyio
async def test_zlib_tier_round_trips_and_evicts_least_recently_used_to_fit() -> None:
    import zlib

    gen = torch.Generator().manual_seed(0)
    chunks = {bytes([i]) * 8: torch.randint(0, 4, (SLOT,), generator=gen, dtype=torch.uint8).numpy().tobytes()
              for i in range(3)}
    compressed = [len(zlib.compress(data, 6)) for data in chunks.values()]
    tier = zlib_tier(capacity_bytes=sum(compressed) - 1)  # all three do not fit: one must go
    first, second, third = chunks
    await tier.write(first, memoryview(chunks[first]))
    await tier.write(second, memoryview(chunks[second]))
    dst = bytearray(SLOT)
    await tier.read(first, memoryview(dst))  # first is now the most recently used
    assert bytes(dst) == chunks[first]
    await tier.write(third, memoryview(chunks[third]))
    assert (tier.known(first), tier.known(second), tier.known(third)) == (True, False, True)
    assert tier.statistics().evictions == 1
    with pytest.raises(ChunkNotFound):
        await tier.read(second, memoryview(dst))


def test_inflate_rejects_damaged_streams_without_touching_the_slot() -> None:
    import zlib

    raw = bytes(range(256)) * 16
    good = zlib.compress(raw)
    for damaged in (good[:-5], good[:20] + bytes([good[20] ^ 0xFF]) + good[21:], good + b"x",
                    zlib.compress(raw + b"!"), b"not zlib"):
        dst = bytearray(len(raw))
        assert custom_tier._inflate_into(damaged, memoryview(dst)) is False
        assert dst == bytearray(len(raw))
    dst = bytearray(len(raw))
    assert custom_tier._inflate_into(good, memoryview(dst)) is True and bytes(dst) == raw


# --- embed_async_server: request parsing -------------------------------------------------------------
async def parse(raw: bytes) -> server_example.Request:
    send, receive = anyio.create_memory_object_stream[bytes](4)
    async with send, receive:
        await send.send(raw)
        return await server_example.read_request(BufferedByteReceiveStream(receive))


@pytest.mark.anyio
@pytest.mark.parametrize(("raw", "status"), [
    (b"POST /prefill HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n", 413),
    (b"POST /prefill HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    (b"POST /prefill HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
    (b"POST /prefill HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /prefill HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/9.9\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nX: " + b"y" * (17 << 10) + b"\r\n\r\n", 431),
])
async def test_server_rejects_bad_requests_before_reading_a_body(raw: bytes, status: int) -> None:
    with pytest.raises(server_example.HTTPError) as caught:
        await parse(raw)
    assert caught.value.status == status


@pytest.mark.anyio
async def test_server_parses_a_request_with_a_body() -> None:
    request = await parse(b"POST /prefill?x=1 HTTP/1.1\r\nContent-Length: 14\r\n\r\n{\"tokens\":[1]}")
    assert (request.method, request.path, request.body) == ("POST", "/prefill", b'{"tokens":[1]}')


@pytest.mark.parametrize("body", [
    b"[1, 2]", b'{"tokens": []}', b'{"tokens": [1], "extra": 1}', b'{"tokens": [true]}',
    b'{"tokens": [-1]}', b'{"tokens": [2147483648]}', b'{"tokens": [1.5]}', b"[" * 100_000, b"\xff",
    b'{"tokens": [1, 2, 3, 4, 5]}',
])
def test_server_prompt_validation_rejects_with_400(body: bytes) -> None:
    with pytest.raises(server_example.HTTPError) as caught:
        server_example.parse_prompt(body, max_tokens=4)
    assert caught.value.status == 400


def test_toy_model_kv_depends_on_the_whole_prefix() -> None:
    model = server_example.ToyModel(server_example.GEOMETRY)
    a = model.compute_kv([1, 2, 3, 4])
    b = model.compute_kv([9, 2, 3, 4])
    assert torch.equal(model.compute_kv([1, 2, 3, 4, 5])[:4], a)  # a longer prompt shares the prefix KV
    assert torch.equal(model.compute_kv([1, 2, 3, 4], start=2), a[2:])
    assert not any(torch.equal(a[i], b[i]) for i in range(4))  # a different first token changes all
