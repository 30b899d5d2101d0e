"""The bench's miniature LLM: a seeded decoder-only transformer and its paged device KV pool.

``TinyDecoder`` does real prefill compute (RMSNorm, rotary attention with grouped KV heads,
SwiGLU MLP) with random weights drawn from a seeded generator, so nothing is downloaded and two
processes with the same seed compute bit-identical logits. Its KV cache lives in a
``DeviceBlockPool``: one cross-layer tensor ``[num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]`` (the layout kvtier copies with one transfer per block) plus a prefix cache that maps
chained block hashes (``kvtier.keys.BlockHasher``) to device blocks and evicts unpinned blocks in
LRU order, like an inference engine's GPU prefix cache.

Two forward paths share the layer math: ``prefill`` reads the cached prefix from the pool and
writes the new tokens' KV into it; ``dense_logits`` recomputes a prompt from scratch with no pool
at all. The bench compares the two on every checked request, which is how it proves that KV
restored from any tier is the KV the model would have computed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtier.keys import BlockHasher

__all__ = [
    "ModelConfig",
    "TinyDecoder",
    "DeviceBlockPool",
    "BlockAllocation",
    "PoolExhausted",
    "rotary",
    "rms_norm",
    "seeded_weight",
    "apply_rotary",
    "LLAMA_8B_FLOPS_PER_TOKEN",
    "LLAMA_8B_KV_BYTES_PER_TOKEN",
]

#: Reference point for realism: Llama-3.1-8B forward FLOPs per token (2 x 8B parameters) ...
LLAMA_8B_FLOPS_PER_TOKEN = 16e9
#: ... and its KV bytes per token in bf16 (32 layers x 8 KV heads x 128 dim x K/V x 2 bytes).
LLAMA_8B_KV_BYTES_PER_TOKEN = 128 * 1024

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the miniature model. Defaults give ~30 MFLOPs and 4 KiB of float32 KV per token."""

    vocab_size: int = 2048
    num_layers: int = 4
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 64
    dtype: str = "float32"
    seed: int = 0
    rope_theta: float = 10000.0
    model_name: str = "kvtier-bench/tiny-decoder"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding pairs)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def parameters_per_layer(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """Forward FLOPs of one prompt token: 2 per weight, plus attention over ``context_tokens``."""
        dense = 2 * self.num_layers * self.parameters_per_layer + 2 * self.hidden_size * self.vocab_size
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_tokens
        return float(dense + attention)

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class TinyDecoder:
    """A decoder-only transformer with seeded random weights (inference only, no autograd)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        dt = config.torch_dtype
        c = config

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            return seeded_weight(gen, fan_in, fan_out, self.device, dt)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = (torch.randn(c.vocab_size, c.hidden_size, generator=gen)).to(self.device, dt)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "wqkv": weight(c.hidden_size, q_dim + 2 * kv_dim),
                    "wo": weight(q_dim, c.hidden_size),
                    "w_gate_up": weight(c.hidden_size, 2 * c.intermediate_size),
                    "w_down": weight(c.intermediate_size, c.hidden_size),
                }
            )
        self.lm_head = weight(c.hidden_size, c.vocab_size)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv_freq.to(self.device)

    # --- public forward paths ----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        num_cached_tokens: int,
        pool: DeviceBlockPool,
        block_ids: Sequence[int],
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits of the last prompt token, computing only ``token_ids[num_cached_tokens:]``.

        The KV of positions ``[0, num_cached_tokens)`` is read from ``pool`` (device blocks
        ``block_ids``, one per token block, however it got there: computed earlier, a device
        prefix-cache hit or loaded by kvtier); the KV of the new tokens is written into the same
        blocks. At least one token must be new (the last token's logits need a forward pass).
        ``before_layer(layer)``, when given, is called before each layer touches the pool: a
        layer-wise load blocks there until that layer's cached prefix is in place.
        """
        n = len(token_ids)
        if not 0 <= num_cached_tokens < n:
            raise ValueError(f"num_cached_tokens must be in [0, {n}), got {num_cached_tokens}")
        bs = self.config.block_size
        if len(block_ids) < -(-n // bs):
            raise ValueError(f"{len(block_ids)} blocks cannot hold {n} tokens")
        table = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(num_cached_tokens, n, device=self.device)
        new_blocks, new_offsets = table[positions // bs], positions % bs
        cached_pos = torch.arange(num_cached_tokens, device=self.device)
        cached_blocks, cached_offsets = table[cached_pos // bs], cached_pos % bs
        kv = pool.kv

        def past(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (kv[cached_blocks, layer, 0, cached_offsets], kv[cached_blocks, layer, 1, cached_offsets])

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            kv[new_blocks, layer, 0, new_offsets] = k
            kv[new_blocks, layer, 1, new_offsets] = v

        return self._forward(token_ids[num_cached_tokens:], num_cached_tokens, past, store, before_layer)

    @torch.inference_mode()
    def dense_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits of the last token from a full recompute with no KV pool (the reference)."""
        if not token_ids:
            raise ValueError("token_ids is empty")
        c = self.config
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, device=self.device, dtype=c.torch_dtype)
        return self._forward(token_ids, 0, lambda layer: (empty, empty), lambda layer, k, v: None)

    # --- layer math ----------------------------------------------------------------------------
    def _forward(
        self,
        new_tokens: Sequence[int],
        start: int,
        past: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        store: Callable[[int, torch.Tensor, torch.Tensor], None],
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        c = self.config
        ids = torch.as_tensor(list(new_tokens), dtype=torch.long, device=self.device)
        n = ids.numel()
        x = self.embed[ids]
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self._rotary(positions)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # Query i sits at absolute position start+i and may see keys 0..start+i.
        key_pos = torch.arange(start + n, device=self.device)
        mask = key_pos[None, :] <= positions[:, None]
        group = c.num_heads // c.num_kv_heads
        for layer, w in enumerate(self.layers):
            if before_layer is not None:
                before_layer(layer)
            h = rms_norm(x)
            qkv = h @ w["wqkv"]
            q = qkv[:, :q_dim].view(n, c.num_heads, c.head_dim)
            k = qkv[:, q_dim : q_dim + kv_dim].view(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_dim + kv_dim :].view(n, c.num_kv_heads, c.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            store(layer, k, v)
            past_k, past_v = past(layer)
            keys = torch.cat([past_k, k]).repeat_interleave(group, dim=1).transpose(0, 1)
            values = torch.cat([past_v, v]).repeat_interleave(group, dim=1).transpose(0, 1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
            x = x + attn.transpose(0, 1).reshape(n, q_dim) @ w["wo"]
            gate, up = (rms_norm(x) @ w["w_gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["w_down"]
        return (rms_norm(x[-1]) @ self.lm_head).float()

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, self._inv_freq, self.config.torch_dtype)


def seeded_weight(gen: torch.Generator, fan_in: int, fan_out: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """A ``[fan_in, fan_out]`` weight drawn from ``gen``, scaled so activations stay O(1) through
    the layers: logits stay well conditioned and a float tolerance check means something."""
    w = torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)
    return w.to(device=device, dtype=dtype)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary embedding at ``positions`` (``[n, 1, head_dim / 2]``, in ``dtype``)."""
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without a learnt scale."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x``'s two halves by the rotary ``cos``/``sin``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ------------------------------------------------------------------------------------------------
class PoolExhausted(RuntimeError):
    """Every device block is pinned by the request being served: the pool is too small for it."""


@dataclass
class BlockAllocation:
    """Device blocks of one request, pinned from ``DeviceBlockPool.acquire`` until ``release``.

    ``block_ids[i]`` holds token block ``i`` of the prompt; the first ``cached_tokens`` tokens
    are device prefix-cache hits whose KV is already in place.
    """

    block_ids: list[int]
    cached_tokens: int
    block_hashes: list[bytes] = field(repr=False)
    released: bool = False


class DeviceBlockPool:
    """Fixed-capacity device KV blocks with an LRU prefix cache keyed by chained block hashes.

    Single-owner, synchronous bookkeeping (the bench serves one request at a time). A block is
    either pinned (by the one live allocation), cached-and-free (evictable, in LRU order) or
    free-and-empty. Eviction takes an empty block first, then the least recently released
    cached block; a request's blocks are released tail-first so its prefix outlives its suffix.
    """

    def __init__(
        self,
        num_blocks: int,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        hasher: BlockHasher | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.config = config
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            num_blocks, config.num_layers, 2, config.block_size, config.num_kv_heads, config.head_dim,
            dtype=config.torch_dtype, device=device,
        )
        self.hasher = hasher or BlockHasher("sha256", config.block_size)
        if self.hasher.block_size != config.block_size:
            raise ValueError("the hasher's block size must be the model's block size")
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # free cached block -> its hash
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._pinned: set[int] = set()
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def cached_blocks(self) -> int:
        return len(self._by_hash)

    def acquire(self, token_ids: Sequence[int]) -> BlockAllocation:
        """Pin the cached prefix of ``token_ids`` and allocate blocks for the rest.

        The cached prefix never covers the last token (its logits must be computed). Raises
        ``PoolExhausted`` (leaving the pool unchanged) when the free blocks cannot hold the rest.
        """
        n = len(token_ids)
        bs = self.config.block_size
        hashes = self.hasher.hash_blocks(token_ids)
        hit_blocks: list[int] = []
        for h in hashes[: (n - 1) // bs]:
            block = self._by_hash.get(h)
            if block is None:
                break
            hit_blocks.append(block)
        needed = -(-n // bs) - len(hit_blocks)
        if needed > len(self._empty) + len(self._lru) - sum(b in self._lru for b in hit_blocks):
            raise PoolExhausted(f"{needed} free blocks needed, pool has {self.num_blocks} in all")
        for block in hit_blocks:
            self._lru.pop(block, None)
            self._pinned.add(block)
        fresh = [self._take_block() for _ in range(needed)]
        self._pinned.update(fresh)
        self.queried_tokens += n
        self.hit_tokens += len(hit_blocks) * bs
        return BlockAllocation(hit_blocks + fresh, len(hit_blocks) * bs, hashes)

    def release(self, alloc: BlockAllocation, *, cache: bool = True) -> None:
        """Unpin ``alloc``'s blocks; with ``cache`` its full blocks become prefix-cache entries.

        Call only after every block's KV is final (computed or loaded). Idempotent.
        """
        if alloc.released:
            return
        alloc.released = True
        # Tail-first: the last block enters the LRU order first (oldest), so it is evicted
        # before the prefix it extends, and the shared prefix outlives every suffix.
        for i in range(len(alloc.block_ids) - 1, -1, -1):
            block = alloc.block_ids[i]
            self._pinned.discard(block)
            if cache and i < len(alloc.block_hashes) and block not in self._hash_of:
                h = alloc.block_hashes[i]
                if h not in self._by_hash:  # an older copy of the same block keeps the entry
                    self._by_hash[h] = block
                    self._hash_of[block] = h
            if block in self._hash_of:
                self._lru[block] = self._hash_of[block]
                self._lru.move_to_end(block)
            else:
                self._empty.append(block)

    def _take_block(self) -> int:
        if self._empty:
            return self._empty.pop()
        block, h = self._lru.popitem(last=False)
        del self._by_hash[h]
        del self._hash_of[block]
        return block
