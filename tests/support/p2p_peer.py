"""A kvtier instance with a p2p tier, driven line by line (a plain script: pytest does not collect it).

``python tests/support/p2p_peer.py CONFIG_JSON`` opens an engine (asyncio) whose secondary tiers are
``CONFIG_JSON["tiers"]`` and prints ``{"event": "ready", "pid": ...}``. It then reads one JSON
command per line on stdin and answers each with one JSON line on stdout, prefixed ``@@ `` (commands run
concurrently, so several loads may be in flight; answers carry the command's ``id``):

With ``"hybrid": true`` in ``CONFIG_JSON`` the model is a hybrid (:func:`hybrid_model`: a
full-attention, a sliding-window and a state group) and ``ok`` checks exactly what each group loads.

* ``{"op": "store", "id", "prompt", "tokens", "params"}`` — fill the device blocks of prompt
  ``prompt`` (content derived from the prompt number and block index) and store its first
  ``tokens`` tokens with ``params`` as ``kv_transfer_params`` → ``{"stored": n}``.
* ``{"op": "load", ...}`` — zero the device blocks, load the prompt with ``params`` →
  ``{"loaded": n, "ok": bool, "seconds": s}``; ``ok`` is false if any loaded block differs.
* ``{"op": "keys", "prompt", "tokens"}`` → ``{"keys": [hex, ...]}``, the prompt's chunk keys.
* ``{"op": "stats"}`` → host pinned slots, jobs in flight, the p2p tier's metrics, open file
  descriptors (``fds``) and resident memory (``rss_bytes``).
* ``{"op": "drop_host"}`` → evict the host tier (``reset_cache``) so loads must use other tiers.
* stdin EOF or ``{"op": "exit"}`` → close the engine and exit 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import anyio  # noqa: E402
import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier import KVGeometry  # noqa: E402

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 32
NUM_BLOCKS = 256


def geometry(model: str = "p2p/model", head_dim: int = DIM) -> KVGeometry:
    return KVGeometry(model, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=head_dim,
                      dtype="float16", block_size=BLOCK)


SLOT_BYTES = geometry().slot_bytes(1)


def tokens_of(prompt: int, n: int) -> list[int]:
    return [(prompt * 7919 + i * 31) % 50000 for i in range(n)]


def block_content(prompt: int, block: int, head_dim: int = DIM) -> list[torch.Tensor]:
    seed = int.from_bytes(hashlib.sha256(f"{prompt}/{block}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((2, BLOCK, HEADS, head_dim), generator=gen).half() for _ in range(LAYERS)]


WINDOW = 8
STATE_BLOCK = 8


def hybrid_model() -> kvtier.KVModel:
    """Full attention (block 4), a sliding window of 8 tokens (block 4), a state (block 8)."""
    group = kvtier.KVCacheGroup
    return kvtier.KVModel("p2p/hybrid", "float16", groups=(
        group.full_attention(block_size=BLOCK, layer_names=["l.0.attn"], num_kv_heads=HEADS, head_dim=DIM),
        group.sliding_window(window=WINDOW, block_size=BLOCK, layer_names=["l.1.attn"], num_kv_heads=HEADS,
                             head_dim=DIM),
        group.mamba(block_size=STATE_BLOCK, layer_names=["l.2.mixer"], state_shapes=[(4, DIM)],
                    state_dtypes=["float32"]),
    ))


def hybrid_content(prompt: int, group: int, block: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"{prompt}/{group}/{block}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    if group == 2:
        return torch.randn((4, DIM), generator=gen)
    return torch.randn((2, BLOCK, HEADS, DIM), generator=gen).half()


def hybrid_loaded(hit: int) -> list[list[int]]:
    """The blocks of each group a load with hit ``hit`` (from 0) writes."""
    if hit == 0:
        return [[], [], []]
    return [list(range(hit // BLOCK)), list(range(max(0, hit - WINDOW) // BLOCK, hit // BLOCK)),
            [hit // STATE_BLOCK - 1]]


class HybridDevice:
    """The hybrid model's device tensors: one per layer (a tuple for the state layer)."""

    def __init__(self) -> None:
        self.groups = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16),
                       torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16),
                       torch.zeros((NUM_BLOCKS, 4, DIM), dtype=torch.float32)]
        self.kv = {"l.0.attn": self.groups[0], "l.1.attn": self.groups[1], "l.2.mixer": (self.groups[2],)}

    @staticmethod
    def block_ids(tokens: int) -> list[list[int]]:
        return [list(range(tokens // BLOCK)), list(range(tokens // BLOCK)), list(range(tokens // STATE_BLOCK))]

    def fill(self, prompt: int, tokens: int) -> None:
        for g, ids in enumerate(self.block_ids(tokens)):
            for b in ids:
                self.groups[g][b] = hybrid_content(prompt, g, b)

    def zero(self) -> None:
        for tensor in self.groups:
            tensor.zero_()

    def holds(self, prompt: int, hit: int) -> bool:
        return all(torch.equal(self.groups[g][b], hybrid_content(prompt, g, b))
                   for g, ids in enumerate(hybrid_loaded(hit)) for b in ids)


def emit(obj: dict[str, Any]) -> None:
    # Marked, so the driver can skip what else reaches stdout (UCX logs there by default).
    os.write(1, ("@@ " + json.dumps(obj) + "\n").encode())


async def main(config: dict[str, Any]) -> None:
    dim = config.get("head_dim", DIM)
    hybrid = HybridDevice() if config.get("hybrid") else None
    geo: kvtier.KVGeometry | kvtier.KVModel = hybrid_model() if hybrid else geometry(config.get("model", "p2p/model"), dim)
    engine_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": config.get("slots", 64) * geo.slot_bytes(1),
        "secondary_tiers": config["tiers"],
    }
    device = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, dim), dtype=torch.float16) for _ in range(LAYERS)]
    lock = anyio.Lock()  # one command touches the device blocks at a time
    async with kvtier.open(engine_config, geo, hybrid.kv if hybrid else device,
                           wait_timeout_s=config.get("wait_timeout_s", 30.0), flush_timeout_s=1.0) as engine:
        emit({"event": "ready", "pid": os.getpid()})

        async def run(cmd: dict[str, Any]) -> None:
            op = cmd["op"]
            answer: dict[str, Any] = {"id": cmd.get("id"), "op": op}
            try:
                if op in ("store", "load"):
                    n = cmd["tokens"]
                    prompt = cmd["prompt"]
                    blocks = list(range(n // BLOCK))
                    async with lock:
                        if hybrid is not None:
                            answer.update(await hybrid_op(engine, hybrid, op, prompt, n, cmd.get("params")))
                        elif op == "store":
                            for b in blocks:
                                for layer, content in enumerate(block_content(prompt, b, dim)):
                                    device[layer][b] = content
                            answer["stored"] = await engine.store(tokens_of(prompt, n), blocks, cmd.get("params"))
                        else:
                            for layer in range(LAYERS):
                                device[layer].zero_()
                            started = time.monotonic()
                            loaded = await engine.load(tokens_of(prompt, n), blocks, cmd.get("params"))
                            answer["seconds"] = time.monotonic() - started
                            answer["loaded"] = loaded
                            answer["ok"] = all(
                                torch.equal(device[layer][b], content)
                                for b in range(loaded // BLOCK)
                                for layer, content in enumerate(block_content(prompt, b, dim))
                            )
                elif op == "keys":
                    answer["keys"] = [key.hex() for key in engine.chunk_keys(tokens_of(cmd["prompt"], cmd["tokens"]))]
                elif op == "stats":
                    stats = engine.manager.host.statistics()
                    answer["pinned_slots"] = stats.pinned_slots
                    answer["used_slots"] = stats.used_slots
                    answer["fds"] = len(os.listdir("/proc/self/fd"))
                    with open("/proc/self/statm") as statm:
                        answer["rss_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                    answer["jobs_in_flight"] = engine.manager.jobs_in_flight
                    for tier in engine.tiers:
                        if tier.tier_type == "p2p":
                            answer["failures"] = {"/".join(k): v for k, v in tier.statistics().failures.items()}
                            answer["p2p"] = {
                                family.name: {",".join(k): v for k, v in family.values.items()
                                              if not hasattr(v, "snapshot")}
                                for family in tier.statistics().custom_metrics
                            }
                elif op == "drop_host":
                    await engine.reset_cache()
                else:
                    answer["error"] = f"unknown op {op!r}"
            except Exception as exc:  # reported, the peer keeps serving
                answer["error"] = f"{type(exc).__name__}: {exc}"
            emit(answer)

        async with anyio.create_task_group() as tg:
            while True:
                line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                if not line:
                    break
                cmd = json.loads(line)
                if cmd["op"] == "exit":
                    break
                tg.start_soon(run, cmd)
            tg.cancel_scope.cancel()
    emit({"event": "closed"})


async def hybrid_op(engine: kvtier.Engine, device: HybridDevice, op: str, prompt: int, n: int,
                    params: dict[str, Any] | None) -> dict[str, Any]:
    """``store`` or ``load`` of the hybrid model (its blocks per group)."""
    if op == "store":
        device.fill(prompt, n)
        return {"stored": await engine.store(tokens_of(prompt, n), device.block_ids(n), params)}
    device.zero()
    started = time.monotonic()
    loaded = await engine.load(tokens_of(prompt, n), device.block_ids(n), params)
    return {"seconds": time.monotonic() - started, "loaded": loaded, "ok": device.holds(prompt, loaded)}


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]), backend="asyncio")
