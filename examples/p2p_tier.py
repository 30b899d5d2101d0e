"""Prefill/decode disaggregation on one machine: a decode process loads a prefill process's KV.

Two kvtier engines, each with a ``p2p`` tier on 127.0.0.1: the *prefill* process (started by this
script as a child) computes a prompt's KV — here, deterministic random tensors — and stores it
with ``remote_decoder``: its chunks are parked in host memory for the decoder. This process, the
*decode* side, loads the same prompt with ``remote_prefiller`` naming the prefill process: the
chunks come over UCX (TCP here; RDMA where the fabric has it) straight into its host slots, and
are copied to its device blocks. The decode side then compares them with what the prefill side
stored, byte for byte.

::

    python examples/p2p_tier.py            # needs the p2p extra: pip install 'kvtier[p2p]' (ucxx)

Without an importable ucxx it prints one line naming the extra and exits with status 2.

The control messages (handshake, fetch, transfer-done) go over ZeroMQ; without an ``auth`` entry
the peers are unauthenticated (kvtier logs a warning once) — see docs/tiers.md, "Peer-to-peer".
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402

GEOMETRY = KVGeometry("example/pd", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
PROMPT = [(11 * i + 5) % 32000 for i in range(16 * 8)]  # 8 full blocks
BLOCKS = list(range(len(PROMPT) // GEOMETRY.block_size))
REQUEST = "example-request-1"


def config(port: int) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 32 * GEOMETRY.slot_bytes(1),
        "secondary_tiers": [{"type": "p2p", "host": "127.0.0.1", "port": port}],
    }


def prompt_kv(num_blocks: int = 16) -> list[torch.Tensor]:
    """The prompt's KV as the prefill side computes it (the same seed on both sides, for checking)."""
    gen = torch.Generator().manual_seed(1234)
    shape = (num_blocks, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    return [torch.randn(shape, generator=gen).half() for _ in range(GEOMETRY.num_layers)]


async def prefill(port: int) -> None:
    device = prompt_kv()
    async with kvtier.open(config(port), GEOMETRY, device) as engine:
        stored = await engine.store(PROMPT, BLOCKS, {"remote_decoder": {"kv_request_id": REQUEST}})
        print(f"STORED {stored}", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # until the decode side is done


async def decode(prefill_port: int, port: int) -> None:
    device = [torch.zeros_like(t) for t in prompt_kv()]
    params = {"remote_prefiller": {"kv_request_id": REQUEST, "remote_host": "127.0.0.1",
                                   "remote_port": prefill_port}}
    async with kvtier.open(config(port), GEOMETRY, device) as engine:
        loaded = await engine.load(PROMPT, BLOCKS, params)
    expected = prompt_kv()
    blocks = loaded // GEOMETRY.block_size
    match = all(torch.equal(device[layer][:blocks], expected[layer][:blocks]) for layer in range(len(device)))
    print(f"decode: loaded {loaded} of {len(PROMPT)} tokens from the prefill process; contents match: {match}")
    if loaded != len(PROMPT) or not match:
        raise SystemExit(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_ucxx() -> None:
    """Exit with one line naming the extra when ucxx cannot be imported (missing, or its libucx)."""
    try:
        import ucxx  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        print(f"p2p_tier.py: the p2p tier needs ucxx, which is not importable here ({exc}); "
              "pip install 'kvtier[p2p]'", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    require_ucxx()
    if len(sys.argv) == 3 and sys.argv[1] == "--prefill":
        anyio.run(prefill, int(sys.argv[2]), backend="asyncio")  # the p2p tier needs asyncio
        return
    prefill_port, decode_port = free_port(), free_port()
    child = subprocess.Popen([sys.executable, __file__, "--prefill", str(prefill_port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = ""
        while not line.startswith("STORED "):  # skip whatever else the child prints
            line = child.stdout.readline()
            if not line:
                raise SystemExit("the prefill process ended early")
        stored = int(line.split()[1])
        print(f"prefill: stored {stored} tokens for {REQUEST}, parked for the decoder")
        anyio.run(decode, prefill_port, decode_port, backend="asyncio")
        child.stdin.close()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    print("p2p_tier: the decode process got the prefill process's KV")


if __name__ == "__main__":
    main()
