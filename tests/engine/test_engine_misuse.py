"""Misuse is loud: a closed engine raises, bad call arguments raise at the call, bad configuration
names its key.

Covers ``kvtier.EngineClosedError`` (every method of a closed ``Engine`` / ``ThreadedEngine``),
the argument checks of ``Engine.load/load_with_sources/store/cached_prefix_tokens/chunk_keys``
(``kvtier/engine/arguments.py``; example tests and a hypothesis property: any mix of good and bad ids
gives a clean result or ``TypeError``/``ValueError``, never another exception, never a hang, never
a copy job for bad ids), and the ``ConfigError`` of ``flush_timeout_s``, ``cpu_bytes_to_use``,
``device_kv``, ``events`` endpoints and ``metrics.port``.
"""

from __future__ import annotations

import math
import random
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import ConfigError, EngineClosedError, KVGeometry

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 32
#: Hang guard only (a correct engine answers in milliseconds); nothing asserts on time.
GUARD_S = 30


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def device_kv(num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    return [torch.zeros((num_blocks, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def host_config(slots: int = 16) -> dict[str, Any]:
    return {"cpu_bytes_to_use": slots * geometry().slot_bytes(1)}


def prompt(chunks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(chunks * BLOCK)]


def nothing_was_queued(engine: kvtier.Engine) -> bool:
    """No copy job ever reached the copy engine, no host slot is used, no tier job runs."""
    stats = engine.statistics()
    copies = stats["copies"]
    return (copies.failures == 0 and copies.bytes_to_host == 0 and copies.bytes_to_device == 0
            and stats["0:primary"].used_slots == 0 and engine.manager.jobs_in_flight == 0)


# ------------------------------------------------------------------------------ closed engine


def test_engine_closed_error_is_a_public_runtime_error() -> None:
    assert issubclass(kvtier.EngineClosedError, RuntimeError)
    assert "EngineClosedError" in dir(kvtier)


@pytest.mark.anyio
async def test_every_method_of_a_closed_engine_raises_engine_closed_error() -> None:
    tokens = prompt(2)
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        assert await engine.store(tokens, [0, 1]) == 2 * BLOCK
    calls = {
        "load": lambda: engine.load(tokens, [2, 3]),
        "load_with_sources": lambda: engine.load_with_sources(tokens, [2, 3]),
        "store": lambda: engine.store(tokens, [0, 1]),
        "drain": lambda: engine.drain(),
        "reset_cache": lambda: engine.reset_cache(),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match=name):
            await call()
    with pytest.raises(EngineClosedError, match="cached_prefix_tokens"):
        engine.cached_prefix_tokens(tokens)  # was 2 * BLOCK: a closed engine claimed a cache
    with pytest.raises(EngineClosedError, match="chunk_keys"):
        engine.chunk_keys(tokens)
    # the final counts stay readable
    assert engine.statistics()["copies"].bytes_to_host > 0


@pytest.mark.anyio
async def test_methods_refuse_while_close_is_still_flushing() -> None:
    tokens = prompt(1)
    config = {**host_config(), "spec_name": "TieringOffloadingSpec",
              "secondary_tiers": [{"type": "faulty", "capacity_bytes": 1 << 24, "latency_s": 60.0}]}
    leaving = anyio.Event()
    refused_with_jobs_in_flight: list[int] = []

    async def call_during_close(engine: kvtier.Engine) -> None:
        await leaving.wait()  # runs at close's first wait, i.e. inside the flush
        with pytest.raises(EngineClosedError, match="closing"):
            engine.cached_prefix_tokens(tokens)
        refused_with_jobs_in_flight.append(engine.manager.jobs_in_flight)

    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tg:
            async with kvtier.open(config, geometry(), device_kv(), flush_timeout_s=1) as engine:
                assert await engine.store(tokens, [0]) == BLOCK
                tg.start_soon(call_during_close, engine)
                leaving.set()
    # refused while the (stuck) cascade was still being waited for
    assert refused_with_jobs_in_flight == [1]


def test_every_method_of_a_closed_threaded_engine_raises_engine_closed_error() -> None:
    tokens = prompt(2)
    engine = kvtier.start_in_thread(host_config(), geometry(), device_kv())
    assert engine.store(tokens, [0, 1]) == 2 * BLOCK
    engine.close()
    calls = {
        "load": lambda: engine.load(tokens, [2, 3]),
        "load_with_sources": lambda: engine.load_with_sources(tokens, [2, 3]),
        "store": lambda: engine.store(tokens, [0, 1]),
        "cached_prefix_tokens": lambda: engine.cached_prefix_tokens(tokens),
        "drain": lambda: engine.drain(),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match=name):
            call()
    assert engine.statistics()["copies"].bytes_to_host > 0  # the final snapshot
    engine.close()  # still idempotent


# ------------------------------------------------------------------------------ bad arguments

BAD_TOKEN_IDS = [
    pytest.param([1, 2, 3.0, 4], TypeError, r"token_ids\[2\]", id="float"),
    pytest.param([1, True, 3, 4], TypeError, r"token_ids\[1\]", id="bool"),
    pytest.param([1, None, 3, 4], TypeError, r"token_ids\[1\]", id="None-element"),
    pytest.param(["1", "2", "3", "4"], TypeError, r"token_ids\[0\]", id="str-elements"),
    pytest.param("abcd", TypeError, "token_ids", id="str"),
    pytest.param(None, TypeError, "token_ids", id="None"),
    pytest.param(7, TypeError, "token_ids", id="int"),
    pytest.param(np.array([1.0, 2.0, 3.0, 4.0]), TypeError, "token_ids", id="float-array"),
    pytest.param(np.ones((2, 4), dtype=np.int64), TypeError, "one-dimensional", id="2d-array"),
    pytest.param([1, 2, -3, 4], ValueError, r"token_ids\[2\] = -3", id="negative"),
    pytest.param([1, 2, 3, 2**64], ValueError, r"token_ids\[3\]", id="too-large"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("token_ids", "error", "match"), BAD_TOKEN_IDS)
async def test_bad_token_ids_raise_at_the_call(token_ids: Any, error: type[Exception], match: str) -> None:
    with anyio.fail_after(GUARD_S):
        async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
            with pytest.raises(error, match=match):
                await engine.store(token_ids, [0])
            with pytest.raises(error, match=match):
                await engine.load(token_ids, [0])
            with pytest.raises(error, match=match):
                await engine.load_with_sources(token_ids, [0])
            with pytest.raises(error, match=match):
                engine.cached_prefix_tokens(token_ids)
            with pytest.raises(error, match=match):
                engine.chunk_keys(token_ids)
            assert nothing_was_queued(engine)


BAD_BLOCK_IDS = [
    pytest.param([0, 1.0], TypeError, r"block_ids\[1\]", id="float"),
    pytest.param([False, 1], TypeError, r"block_ids\[0\]", id="bool"),
    pytest.param([0, None], TypeError, r"block_ids\[1\]", id="None-element"),
    pytest.param(None, TypeError, "block_ids", id="None"),
    pytest.param([0, -1], ValueError, r"block_ids\[1\] = -1", id="negative"),
    pytest.param([0, NUM_BLOCKS], ValueError, rf"block_ids\[1\] = {NUM_BLOCKS}.*\[0, {NUM_BLOCKS}\)", id="too-large"),
    pytest.param([5, 5], ValueError, r"block_ids\[1\] = 5 repeats block_ids\[0\]", id="duplicate"),
    pytest.param([5], ValueError, "2 device blocks are needed", id="too-short"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("block_ids", "error", "match"), BAD_BLOCK_IDS)
async def test_bad_block_ids_raise_at_the_call_before_any_copy(block_ids: Any, error: type[Exception],
                                                               match: str) -> None:
    tokens = prompt(2, seed=1)
    with anyio.fail_after(GUARD_S):
        # wait_timeout_s is long: an id that reached the copy engine used to stall the call
        async with kvtier.open(host_config(), geometry(), device_kv(), wait_timeout_s=60) as engine:
            with pytest.raises(error, match=match):
                await engine.store(tokens, block_ids)
            assert nothing_was_queued(engine)
            with pytest.raises(error, match=match):
                await engine.load(tokens, block_ids)
            with pytest.raises(error, match=match):
                await engine.load_with_sources(tokens, block_ids)
            assert nothing_was_queued(engine)


@pytest.mark.anyio
async def test_load_checks_the_block_ids_it_may_use_even_when_nothing_is_cached() -> None:
    tokens = prompt(3, seed=2)
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        # nothing cached: the old engine returned 0 and never looked at the block ids
        with pytest.raises(ValueError, match=rf"out of range.*\[0, {NUM_BLOCKS}\)"):
            await engine.load(tokens, [0, 1, 10**6])
        with pytest.raises(ValueError, match="repeats"):
            await engine.load(tokens, [0, 1, 1])


@pytest.mark.anyio
async def test_range_and_duplicates_are_checked_on_the_block_ids_the_call_uses() -> None:
    tokens = prompt(2, seed=3)
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        with pytest.raises(ValueError, match="repeats"):
            await engine.store(tokens + [1, 2], [0, 0, 1])
        # the trailing partial block is never offloaded: its id may repeat or be out of range
        assert await engine.store(tokens + [1, 2], [0, 1, 1]) == 2 * BLOCK
        assert await engine.store(prompt(2, seed=4) + [1], [2, 3, 10**6]) == 2 * BLOCK
        # the caller already holds chunk 0 (num_computed_tokens): its block is not used
        assert await engine.load(tokens, [7, 7], num_computed_tokens=BLOCK) == BLOCK
        # max_offload_tokens=0 offloads nothing, so no block is used
        assert await engine.store(prompt(2, seed=5), [9, 9], {"max_offload_tokens": 0}) == 0
        # the caller already holds every chunk: nothing to load, no block used
        assert await engine.load(tokens, [], num_computed_tokens=100) == 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_computed_tokens": -1}, ValueError, "num_computed_tokens"),
        ({"num_computed_tokens": 1.5}, TypeError, "num_computed_tokens"),
        ({"num_computed_tokens": True}, TypeError, "num_computed_tokens"),
        ({"num_computed_tokens": None}, TypeError, "num_computed_tokens"),
    ],
)
async def test_bad_num_computed_tokens_raise(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        with pytest.raises(error, match=match):
            await engine.load(prompt(1), [0], **kwargs)
        with pytest.raises(error, match=match):
            await engine.load_with_sources(prompt(1), [0], **kwargs)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "error"), [(-2, ValueError), ("8", TypeError), (2.0, TypeError), (False, TypeError)]
)
async def test_bad_num_prompt_tokens_raise(value: Any, error: type[Exception]) -> None:
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        with pytest.raises(error, match="num_prompt_tokens"):
            await engine.store(prompt(2), [0, 1], num_prompt_tokens=value)
        assert nothing_was_queued(engine)


@pytest.mark.anyio
async def test_numpy_ids_are_accepted_and_key_like_python_ints() -> None:
    tokens = prompt(2, seed=6)
    async with kvtier.open(host_config(), geometry(), device_kv()) as engine:
        as_scalars = [np.int64(t) for t in tokens]
        assert await engine.store(as_scalars, [np.int32(0), np.int64(1)], num_prompt_tokens=np.int64(8)) == 2 * BLOCK
        # the chunks stored from numpy scalars are the plain-int prompt's chunks
        assert engine.cached_prefix_tokens(tokens) == 2 * BLOCK
        assert engine.chunk_keys(np.array(tokens)) == engine.chunk_keys(tuple(tokens))
        assert await engine.load(torch.tensor(tokens), np.array([4, 5]), num_computed_tokens=np.int64(0)) == 2 * BLOCK


@pytest.mark.anyio
async def test_without_device_kv_the_type_checks_still_apply() -> None:
    async with kvtier.open(host_config(), geometry()) as engine:
        with pytest.raises(TypeError, match="token_ids"):
            engine.cached_prefix_tokens([1, 2, 3, 4.5])
        with pytest.raises(ValueError, match="token_ids"):
            engine.chunk_keys([-1, 2, 3, 4])
        assert engine.num_device_blocks is None
        assert engine.cached_prefix_tokens(prompt(1)) == 0


# Elements: mostly good ids, sometimes numpy ones, sometimes wrong in type or range.
_ANY_ID = st.one_of(
    st.integers(0, NUM_BLOCKS - 1),
    st.integers(0, NUM_BLOCKS - 1).map(np.int64),
    st.integers(-3, -1),
    st.integers(NUM_BLOCKS, 2**70),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=2),
)
_GARBAGE = st.sampled_from([None, "abcd", 3, 2.5, b"\x01\x02"])
_GOOD_TOKENS = st.lists(st.integers(0, 50_000), min_size=BLOCK, max_size=3 * BLOCK)
_TOKENS = st.one_of(
    _GOOD_TOKENS, _GOOD_TOKENS.map(tuple), _GOOD_TOKENS.map(np.array),
    st.lists(_ANY_ID, max_size=3 * BLOCK), _GARBAGE,
)
_GOOD_BLOCKS = st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=4, unique=True)
_BLOCKS = st.one_of(
    _GOOD_BLOCKS, _GOOD_BLOCKS.map(tuple), _GOOD_BLOCKS.map(lambda ids: np.array(ids, dtype=np.int32)),
    st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4),  # duplicates possible
    st.lists(_ANY_ID, max_size=4), _GARBAGE,
)


def _well_formed_ids(values: Any) -> bool:
    """A list or tuple of non-negative, non-bool ints, or a 1-D integer array of them."""
    if isinstance(values, np.ndarray):
        return values.ndim == 1 and values.dtype.kind in "iu" and bool((values >= 0).all())
    if not isinstance(values, (list, tuple)):
        return False
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values)


@pytest.fixture
async def shared_engine() -> AsyncIterator[kvtier.Engine]:
    async with kvtier.open(host_config(slots=8), geometry(), device_kv(), wait_timeout_s=60) as engine:
        yield engine


@pytest.mark.anyio
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["store", "store", "load", "load_with_sources", "cached_prefix_tokens"]),
    token_ids=_TOKENS,
    block_ids=_BLOCKS,
    num_computed=st.one_of(st.integers(-2, 12), st.sampled_from([1.5, None, True])),
)
async def test_any_mix_of_ids_gives_a_clean_result_or_a_type_or_value_error(
    shared_engine: kvtier.Engine, method: str, token_ids: Any, block_ids: Any, num_computed: Any
) -> None:
    engine = shared_engine
    with anyio.fail_after(GUARD_S):
        try:
            if method == "store":
                result: Any = await engine.store(token_ids, block_ids)
            elif method == "cached_prefix_tokens":
                result = engine.cached_prefix_tokens(token_ids)
            else:
                outcome = await getattr(engine, method)(token_ids, block_ids, num_computed_tokens=num_computed)
                result = outcome if isinstance(outcome, int) else outcome.tokens
        except (TypeError, ValueError):
            result = None
    if result is not None:  # a clean result: every argument the call took was well formed
        assert isinstance(result, int) and 0 <= result <= len(token_ids)
        assert _well_formed_ids(token_ids)
        if method != "cached_prefix_tokens":
            assert _well_formed_ids(block_ids)
        if method.startswith("load"):
            assert type(num_computed) is int and num_computed >= 0
    # whatever was asked, no bad id ever reached the copy engine and nothing stays pinned
    stats = engine.statistics()
    assert stats["copies"].failures == 0
    assert stats["0:primary"].pinned_slots == 0
    assert engine.manager.jobs_in_flight == 0


# ------------------------------------------------------------------------------ configuration


@pytest.mark.anyio
@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, "5", True, None])
async def test_bad_flush_timeout_s_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError, match="flush_timeout_s"):
        async with kvtier.open(host_config(), geometry(), device_kv(), flush_timeout_s=value):
            pytest.fail("kvtier.open yielded")  # pragma: no cover


def test_start_in_thread_validates_flush_timeout_s() -> None:
    with pytest.raises(ConfigError, match="flush_timeout_s"):
        kvtier.start_in_thread(host_config(), geometry(), device_kv(), flush_timeout_s=-1)


@pytest.mark.anyio
async def test_cpu_bytes_to_use_beyond_the_machine_is_a_config_error_naming_it() -> None:
    huge = 1 << 50  # 1 PiB: more than any address space here can map
    with pytest.raises(ConfigError, match=rf"cpu_bytes_to_use: {huge}.*cannot allocate"):
        async with kvtier.open({"cpu_bytes_to_use": huge}, geometry(), device_kv()):
            pytest.fail("kvtier.open yielded")  # pragma: no cover
    # also without device_kv: the buffer is allocated at start-up, not on first use
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        async with kvtier.open({"cpu_bytes_to_use": huge}, geometry()):
            pytest.fail("kvtier.open yielded")  # pragma: no cover


@pytest.mark.anyio
async def test_non_contiguous_device_kv_is_a_config_error_naming_the_tensor() -> None:
    kv = device_kv()
    # same shape, but K/V-major underneath (a transposed view)
    kv[1] = torch.zeros((2, NUM_BLOCKS, BLOCK, HEADS, DIM), dtype=torch.float16).transpose(0, 1)
    with pytest.raises(ConfigError, match=r"device_kv\[1\] must be contiguous"):
        async with kvtier.open(host_config(), geometry(), kv):
            pytest.fail("kvtier.open yielded")  # pragma: no cover
    cross = torch.zeros((LAYERS, NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16).transpose(0, 1)
    with pytest.raises(ConfigError, match=r"device_kv must be contiguous"):
        async with kvtier.open(host_config(), geometry(), cross):
            pytest.fail("kvtier.open yielded")  # pragma: no cover


@pytest.mark.anyio
async def test_shape_errors_name_the_dimensions_of_each_layout() -> None:
    bad = device_kv()
    bad[0] = torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM + 1), dtype=torch.float16)
    with pytest.raises(ConfigError) as per_layer:
        async with kvtier.open(host_config(), geometry(), bad):
            pytest.fail("kvtier.open yielded")  # pragma: no cover
    assert str(per_layer.value).endswith(
        f"expected ('num_blocks', 2, {BLOCK}, {HEADS}, {DIM}) "
        "(num_blocks, K/V, block_size, this rank's kv heads, head_dim)"
    )
    cross = torch.zeros((NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS + 1, DIM), dtype=torch.float16)
    with pytest.raises(ConfigError) as cross_layer:
        async with kvtier.open(host_config(), geometry(), cross):
            pytest.fail("kvtier.open yielded")  # pragma: no cover
    assert str(cross_layer.value).endswith(
        f"expected ('num_blocks', {LAYERS}, 2, {BLOCK}, {HEADS}, {DIM}) "
        "(num_blocks, num_layers, K/V, block_size, this rank's kv heads, head_dim)"
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("events", "key"),
    [
        ({"endpoint": "tcp://127.0.0.1:99999"}, "events.endpoint"),
        ({"endpoint": "tcp://300.1.1.1:5557"}, "events.endpoint"),
        ({"endpoint": "tcp://127.0.0.1"}, "events.endpoint"),
        ({"endpoint": "tcp://bad host!:5557"}, "events.endpoint"),
        ({"endpoint": "inproc://"}, "events.endpoint"),
        ({"endpoint": "tcp://*:*", "replay_endpoint": "tcp://[::1:5558"}, "events.replay_endpoint"),
        # the rank offset pushes the port out of range
        ({"endpoint": "tcp://*:65535", "data_parallel_rank": 1}, "events.endpoint"),
    ],
)
async def test_malformed_event_endpoints_are_config_errors_before_open_yields(events: dict[str, Any],
                                                                              key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        async with kvtier.open(host_config(), geometry(), device_kv(), events=events):
            pytest.fail("kvtier.open yielded")  # pragma: no cover


@pytest.fixture
def busy_port() -> Any:
    """A TCP port some other socket is listening on (all interfaces)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(1)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.mark.anyio
async def test_event_endpoints_that_cannot_be_bound_are_config_errors_before_open_yields(busy_port: int) -> None:
    with anyio.fail_after(GUARD_S):
        with pytest.raises(ConfigError, match=rf"events\.endpoint: cannot bind 'tcp://\*:{busy_port}'"):
            async with kvtier.open(host_config(), geometry(), device_kv(),
                                   events={"endpoint": f"tcp://*:{busy_port}"}):
                pytest.fail("kvtier.open yielded")  # pragma: no cover
        with pytest.raises(ConfigError, match=r"events\.replay_endpoint: cannot bind"):
            async with kvtier.open(host_config(), geometry(), device_kv(),
                                   events={"endpoint": "tcp://127.0.0.1:*",
                                           "replay_endpoint": f"tcp://*:{busy_port}"}):
                pytest.fail("kvtier.open yielded")  # pragma: no cover
        missing_dir = Path(tempfile.gettempdir()) / "kvtier-no-such-dir" / "sub" / "events.sock"
        with pytest.raises(ConfigError, match=r"events\.endpoint: cannot bind 'ipc://"):
            async with kvtier.open(host_config(), geometry(), device_kv(),
                                   events={"endpoint": f"ipc://{missing_dir}"}):
                pytest.fail("kvtier.open yielded")  # pragma: no cover


@pytest.mark.anyio
async def test_busy_metrics_port_is_a_config_error_naming_metrics_port(busy_port: int) -> None:
    with pytest.raises(ConfigError, match=rf"metrics\.port: cannot serve metrics on 127\.0\.0\.1:{busy_port}"):
        async with kvtier.open(host_config(), geometry(), device_kv(), metrics={"port": busy_port}):
            pytest.fail("kvtier.open yielded")  # pragma: no cover
