"""The bench's miniature hybrid LLM: full attention, sliding-window attention and a recurrent layer.

``HybridDecoder`` is ``TinyDecoder``'s hybrid sibling: seeded random weights (two processes with
the same seed compute bit-identical logits), RMSNorm and a SwiGLU MLP after every layer, and one
of three token mixers per layer (``HybridConfig.layer_kinds``):

* ``"full"`` — rotary attention with grouped KV heads over every earlier token;
* ``"sliding"`` — the same attention restricted to the last ``window`` tokens: the query at
  position ``p`` sees keys ``p - window + 1 .. p`` and nothing older, in the paged prefill (which
  reads only those keys from the pool) and in the dense recompute (which masks the rest), so
  logits that match a recompute prove that a window-only reload put back every key it needs;
* ``"recurrent"`` — a gated linear recurrence with a short causal convolution before it (a
  miniature Mamba mixer): ``u = conv(x W_in)``, ``a = (1 + sigmoid(x W_a + b_a)) / 2``,
  ``h_t = a_t * h_{t-1} + (1 - a_t) * u_t``, output ``(h_t * silu(x W_g)) W_out``. Its state after
  token ``t`` is two tensors: the convolution's last ``conv_width - 1`` inputs and ``h_t``.

``HybridConfig.kv_model`` describes its KV cache to kvtier as one KV-cache group per kind
(full attention, sliding window, mamba, in that order, absent kinds left out);
``HybridConfig.twin`` is the *full-attention twin*: the same sizes and seed with every layer,
the recurrent one included, a full-attention layer.

Its device memory is a ``HybridBlockPool``: per layer, ``[num_blocks, 2, block_size, kv_heads,
head_dim]`` for attention and ``([num_blocks, conv_width - 1, state_size], [num_blocks,
state_size])`` for the recurrent layer (``HybridBlockPool.device_kv`` is the mapping kvtier
copies), one block table per group. The pool has **no device prefix cache**: every request gets
fresh blocks and its prefix comes from kvtier or is recomputed. A block handed out holds NaN
until something writes it, so a prefill that reads a block nobody loaded or computed returns
NaN logits and fails the bench's check.

``HybridDecoder.prefill`` reads what the pool holds for the first ``num_cached_tokens`` tokens —
full-attention K/V of all of them, sliding-window K/V of the last ``window - 1`` of them, the
recurrent state in the block ending at ``num_cached_tokens`` — and computes the rest. It writes
every new token's K/V and, in the state block of each token block it completes, the state after
that block's last token (what kvtier stores for the group). ``dense_logits`` recomputes a prompt
with no pool at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvtier.bench.model import PoolExhausted, apply_rotary, rms_norm, rotary, seeded_weight

__all__ = ["LAYER_KINDS", "HybridConfig", "HybridDecoder", "HybridBlockPool", "HybridAllocation"]

#: What a layer of the hybrid model mixes tokens with.
LAYER_KINDS = ("full", "sliding", "recurrent")
#: kvtier's KV-cache group kind of each layer kind, in group order.
_GROUP_KIND = {"full": "full_attention", "sliding": "sliding_window", "recurrent": "mamba"}

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class HybridConfig:
    """Shape of the miniature hybrid model (defaults: 6 layers, ~10 MFLOPs per token).

    ``window`` is the sliding-window layers' span in tokens; ``state_block_size`` the recurrent
    group's block size in tokens (its state alignment; default ``block_size``). The dtype is a
    float dtype precise enough for the bench's tolerance (float32 or float64).
    """

    vocab_size: int = 2048
    layer_kinds: tuple[str, ...] = ("full", "sliding", "sliding", "full", "sliding", "recurrent")
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16
    window: int = 64
    state_size: int = 256
    conv_width: int = 4
    state_block_size: int | None = None
    dtype: str = "float32"
    seed: int = 0
    rope_theta: float = 10000.0
    model_name: str = "kvtier-bench/tiny-hybrid"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.layer_kinds or any(kind not in LAYER_KINDS for kind in self.layer_kinds):
            raise ValueError(f"layer_kinds must be a non-empty sequence of {LAYER_KINDS}, got {self.layer_kinds!r}")
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "block_size", "window", "state_size", "state_block_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.conv_width < 2:
            raise ValueError(f"conv_width must be >= 2 (the state holds conv_width - 1 inputs), got {self.conv_width}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding pairs)")

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def state_block(self) -> int:
        """Tokens per block of the recurrent group (``state_block_size`` or ``block_size``)."""
        return self.state_block_size or self.block_size

    def layer_name(self, layer: int) -> str:
        """vLLM-style name of layer ``layer`` (attention layers ``...self_attn.attn``, the recurrent one ``...mixer``)."""
        suffix = "mixer" if self.layer_kinds[layer] == "recurrent" else "self_attn.attn"
        return f"model.layers.{layer}.{suffix}"

    def groups(self) -> list[tuple[str, list[int]]]:
        """``(layer kind, layers)`` of each KV-cache group, in group order (kinds present only)."""
        return [(kind, [i for i, k in enumerate(self.layer_kinds) if k == kind])
                for kind in LAYER_KINDS if kind in self.layer_kinds]

    def group_block_size(self, kind: str) -> int:
        return self.state_block if kind == "recurrent" else self.block_size

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the recurrent state: the convolution's last inputs, then ``h``."""
        return (self.conv_width - 1, self.state_size), (self.state_size,)

    def kv_model(self) -> Any:
        """The ``kvtier.KVModel`` of this model's device pool (one group per kind)."""
        from kvtier.model import KVCacheGroup, KVModel

        groups = []
        for kind, layers in self.groups():
            names = [self.layer_name(i) for i in layers]
            if kind == "full":
                groups.append(KVCacheGroup.full_attention(block_size=self.block_size, layer_names=names,
                                                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim))
            elif kind == "sliding":
                groups.append(KVCacheGroup.sliding_window(window=self.window, block_size=self.block_size,
                                                          layer_names=names, num_kv_heads=self.num_kv_heads,
                                                          head_dim=self.head_dim))
            else:
                groups.append(KVCacheGroup.mamba(block_size=self.state_block, layer_names=names,
                                                 state_shapes=self.state_shapes,
                                                 state_dtypes=[self.dtype] * len(self.state_shapes)))
        return KVModel(self.model_name, self.dtype, tuple(groups))

    def twin(self) -> HybridConfig:
        """The full-attention twin: same sizes and seed, every layer full attention."""
        return replace(self, layer_kinds=("full",) * self.num_layers, model_name=self.model_name + "-twin")

    @property
    def is_twin(self) -> bool:
        return all(kind == "full" for kind in self.layer_kinds)

    # ------------------------------------------------------------------ cost
    @property
    def attention_bytes_per_token(self) -> int:
        """K/V bytes one token takes in one attention layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent layer's state."""
        return sum(math.prod(shape) for shape in self.state_shapes) * self.itemsize

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of context that grows with the context (full-attention layers)."""
        return self.layer_kinds.count("full") * self.attention_bytes_per_token

    def parameters_per_layer(self, kind: str) -> int:
        h, q, kv, s = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.state_size
        mixer = 3 * h * s + s * h if kind == "recurrent" else h * q + 2 * h * kv + q * h
        return mixer + 3 * h * self.intermediate_size

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """Forward FLOPs of one prompt token: 2 per weight, plus attention over its context."""
        dense = sum(2 * self.parameters_per_layer(kind) for kind in self.layer_kinds)
        dense += 2 * self.hidden_size * self.vocab_size
        attention = 0
        for kind in self.layer_kinds:
            if kind != "recurrent":
                span = min(context_tokens, self.window) if kind == "sliding" else context_tokens
                attention += 4 * self.num_heads * self.head_dim * span
        return float(dense + attention)


# ------------------------------------------------------------------------------------------------
class _LayerIO(Protocol):
    """Where a forward pass finds the cached prefix and puts what it computes."""

    def past(self, layer: int, first: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def store_state(self, layer: int, end: int, conv: torch.Tensor, h: torch.Tensor) -> None: ...


class HybridDecoder:
    """A decoder-only hybrid model with seeded random weights (inference only, no autograd)."""

    def __init__(self, config: HybridConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        dt = config.torch_dtype
        c = config

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            return seeded_weight(gen, fan_in, fan_out, self.device, dt)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen).to(self.device, dt)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.layer_kinds:
            if kind == "recurrent":
                mixer = {
                    "w_in": weight(c.hidden_size, c.state_size),
                    "conv": (torch.randn(c.conv_width, c.state_size, generator=gen) / c.conv_width).to(self.device, dt),
                    "w_a": weight(c.hidden_size, c.state_size),
                    "b_a": torch.randn(c.state_size, generator=gen).to(self.device, dt),
                    "w_g": weight(c.hidden_size, c.state_size),
                    "w_out": weight(c.state_size, c.hidden_size),
                }
            else:
                mixer = {"wqkv": weight(c.hidden_size, q_dim + 2 * kv_dim), "wo": weight(q_dim, c.hidden_size)}
            mixer["w_gate_up"] = weight(c.hidden_size, 2 * c.intermediate_size)
            mixer["w_down"] = weight(c.intermediate_size, c.hidden_size)
            self.layers.append(mixer)
        self.lm_head = weight(c.hidden_size, c.vocab_size)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv_freq.to(self.device)

    # --- public forward paths ----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], num_cached_tokens: int, pool: HybridBlockPool,
                block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits of the last prompt token, computing only ``token_ids[num_cached_tokens:]``.

        ``block_ids[g][i]`` is the device block of group ``g``'s token block ``i`` (the groups
        of ``config.groups()``). What the first ``num_cached_tokens`` tokens left in the pool is
        read (module docstring), however it got there; with a recurrent layer,
        ``num_cached_tokens`` must be a multiple of its block size. At least one token must be new.
        """
        c = self.config
        n = len(token_ids)
        if not 0 <= num_cached_tokens < n:
            raise ValueError(f"num_cached_tokens must be in [0, {n}), got {num_cached_tokens}")
        if "recurrent" in c.layer_kinds and num_cached_tokens % c.state_block:
            raise ValueError(f"num_cached_tokens ({num_cached_tokens}) must be a multiple of the recurrent "
                             f"block size {c.state_block}: the state is kept at block ends only")
        groups = c.groups()
        if len(block_ids) != len(groups):
            raise ValueError(f"expected one block list per group ({len(groups)}), got {len(block_ids)}")
        for (kind, _), blocks in zip(groups, block_ids):
            bs = c.group_block_size(kind)
            if len(blocks) < -(-n // bs):
                raise ValueError(f"{len(blocks)} {kind} blocks cannot hold {n} tokens")
        return self._forward(token_ids[num_cached_tokens:], num_cached_tokens,
                             _PagedIO(pool, block_ids, num_cached_tokens, n, self.device))

    @torch.inference_mode()
    def dense_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits of the last token from a full recompute with no pool (the reference)."""
        if not token_ids:
            raise ValueError("token_ids is empty")
        return self._forward(token_ids, 0, _DenseIO(self.config, self.device))

    # --- layer math ----------------------------------------------------------------------------
    def _forward(self, new_tokens: Sequence[int], start: int, io: _LayerIO) -> torch.Tensor:
        c = self.config
        ids = torch.as_tensor(list(new_tokens), dtype=torch.long, device=self.device)
        n = ids.numel()
        x = self.embed[ids]
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self._rotary(positions)
        for layer, (kind, w) in enumerate(zip(c.layer_kinds, self.layers)):
            h = rms_norm(x)
            if kind == "recurrent":
                x = x + self._recurrent(layer, h, start, io, w)
            else:
                x = x + self._attention(layer, kind, h, positions, cos, sin, io, w)
            gate, up = (rms_norm(x) @ w["w_gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["w_down"]
        return (rms_norm(x[-1]) @ self.lm_head).float()

    def _attention(self, layer: int, kind: str, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, io: _LayerIO, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        c = self.config
        n, start = h.shape[0], int(positions[0])
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = h @ w["wqkv"]
        q = qkv[:, :q_dim].view(n, c.num_heads, c.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(n, c.num_kv_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        io.store_kv(layer, k, v)
        # A sliding-window layer's first new query (at `start`) reaches back window - 1 tokens:
        # older cached keys are never read.
        first = max(0, start - c.window + 1) if kind == "sliding" else 0
        past_k, past_v = io.past(layer, first)
        key_pos = torch.arange(first, start + n, device=self.device)
        mask = key_pos[None, :] <= positions[:, None]
        if kind == "sliding":
            mask &= key_pos[None, :] > positions[:, None] - c.window
        group = c.num_heads // c.num_kv_heads
        keys = torch.cat([past_k, k]).repeat_interleave(group, dim=1).transpose(0, 1)
        values = torch.cat([past_v, v]).repeat_interleave(group, dim=1).transpose(0, 1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return attn.transpose(0, 1).reshape(n, q_dim) @ w["wo"]

    def _recurrent(self, layer: int, h: torch.Tensor, start: int, io: _LayerIO,
                   w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        c = self.config
        n, width = h.shape[0], c.conv_width
        conv_state, state = io.state(layer)
        padded = torch.cat([conv_state, h @ w["w_in"]])  # input t sits at row t + width - 1
        u = sum(w["conv"][j] * padded[j : j + n] for j in range(width))
        a = 0.5 + 0.5 * torch.sigmoid(h @ w["w_a"] + w["b_a"])
        drive = (1 - a) * u
        out = torch.empty_like(drive)
        bs = c.state_block
        for t in range(n):
            state = torch.addcmul(drive[t], a[t], state)
            out[t] = state
            end = start + t + 1
            if end % bs == 0:
                io.store_state(layer, end, padded[t + 1 : t + width], state)
        return (out * F.silu(h @ w["w_g"])) @ w["w_out"]

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, self._inv_freq, self.config.torch_dtype)


class _DenseIO:
    """No pool: nothing cached, nothing kept, the recurrence starts from zeros."""

    def __init__(self, config: HybridConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def past(self, layer: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        empty = torch.empty(0, c.num_kv_heads, c.head_dim, device=self.device, dtype=c.torch_dtype)
        return empty, empty

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pass

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        conv_shape, h_shape = c.state_shapes
        return (torch.zeros(conv_shape, device=self.device, dtype=c.torch_dtype),
                torch.zeros(h_shape, device=self.device, dtype=c.torch_dtype))

    def store_state(self, layer: int, end: int, conv: torch.Tensor, h: torch.Tensor) -> None:
        pass


class _PagedIO:
    """A prefill's view of the pool: reads the cached prefix, writes the new tokens' K/V and states."""

    def __init__(self, pool: HybridBlockPool, block_ids: Sequence[Sequence[int]], start: int, end: int,
                 device: torch.device) -> None:
        self.pool = pool
        self.config = pool.config
        self.start = start
        self.tables = [torch.as_tensor(list(blocks), dtype=torch.long, device=device) for blocks in block_ids]
        self.block_ids = [list(blocks) for blocks in block_ids]
        self.device = device
        new = torch.arange(start, end, device=device)
        self._new = new
        self._group_of = {layer: g for g, (_, layers) in enumerate(self.config.groups()) for layer in layers}

    def _where(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.config.block_size
        return self.tables[self._group_of[layer]][positions // bs], positions % bs

    def past(self, layer: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self._where(layer, torch.arange(first, self.start, device=self.device))
        kv = self.pool.kv[layer]
        return kv[blocks, 0, offsets], kv[blocks, 1, offsets]

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks, offsets = self._where(layer, self._new)
        kv = self.pool.kv[layer]
        kv[blocks, 0, offsets] = k
        kv[blocks, 1, offsets] = v

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.start == 0:
            return _DenseIO(self.config, self.device).state(layer)
        block = self.block_ids[self._group_of[layer]][self.start // self.config.state_block - 1]
        conv, h = self.pool.state[layer]
        return conv[block].clone(), h[block].clone()

    def store_state(self, layer: int, end: int, conv: torch.Tensor, h: torch.Tensor) -> None:
        block = self.block_ids[self._group_of[layer]][end // self.config.state_block - 1]
        conv_pool, h_pool = self.pool.state[layer]
        conv_pool[block] = conv
        h_pool[block] = h


# ------------------------------------------------------------------------------------------------
@dataclass
class HybridAllocation:
    """Device blocks of one request, one list per group: ``block_ids[g][i]`` holds group ``g``'s
    token block ``i``. Pinned from ``HybridBlockPool.acquire`` until ``release``."""

    block_ids: list[list[int]]
    cached_tokens: int = 0  # no device prefix cache: always 0
    released: bool = field(default=False, repr=False)


class HybridBlockPool:
    """Fixed-capacity paged device memory of a ``HybridDecoder``, one block table per group.

    ``num_blocks`` blocks per group. No prefix cache (module docstring): ``acquire`` hands out
    fresh blocks, filled with NaN, and ``release`` only frees them. Single-owner, synchronous.
    """

    def __init__(self, num_blocks: int, config: HybridConfig, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.config = config
        self.num_blocks = num_blocks
        c, dt = config, config.torch_dtype
        self.kv: dict[int, torch.Tensor] = {}
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, kind in enumerate(c.layer_kinds):
            if kind == "recurrent":
                self.state[layer] = tuple(  # type: ignore[assignment]
                    torch.zeros(num_blocks, *shape, dtype=dt, device=device) for shape in c.state_shapes)
            else:
                self.kv[layer] = torch.zeros(num_blocks, 2, c.block_size, c.num_kv_heads, c.head_dim,
                                             dtype=dt, device=device)
        groups = c.groups()
        # Each group hands out its blocks from a different place (highest first), so the block
        # tables of a request differ between groups and from the token order.
        self._free = [[(b + g * num_blocks // len(groups)) % num_blocks for b in range(num_blocks)]
                      for g in range(len(groups))]

    def device_kv(self) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        """Layer name → its device tensor (attention) or tuple of state tensors (recurrent)."""
        out: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        for layer in range(self.config.num_layers):
            out[self.config.layer_name(layer)] = self.state[layer] if layer in self.state else self.kv[layer]
        return out

    def acquire(self, token_ids: Sequence[int]) -> HybridAllocation:
        """Fresh blocks for ``token_ids`` in every group (``DeviceBlockPool.acquire``'s signature;
        nothing is cached); ``PoolExhausted`` (pool unchanged) when a group has too few free blocks."""
        num_tokens = len(token_ids)
        c = self.config
        groups = c.groups()
        needed = [-(-num_tokens // c.group_block_size(kind)) for kind, _ in groups]
        for (kind, _), free, count in zip(groups, self._free, needed):
            if count > len(free):
                raise PoolExhausted(f"{count} free {kind} blocks needed, pool has {self.num_blocks} in all")
        block_ids = []
        for (_, layers), free, count in zip(groups, self._free, needed):
            blocks = [free.pop() for _ in range(count)]
            index = torch.as_tensor(blocks, dtype=torch.long, device=self._device)
            for layer in layers:
                for tensor in self.state.get(layer, ()) or (self.kv[layer],):
                    tensor.index_fill_(0, index, math.nan)
            block_ids.append(blocks)
        return HybridAllocation(block_ids)

    def release(self, alloc: HybridAllocation) -> None:
        """Free ``alloc``'s blocks (idempotent); their contents are not kept for anyone."""
        if alloc.released:
            return
        alloc.released = True
        for free, blocks in zip(self._free, alloc.block_ids):
            free.extend(reversed(blocks))

    @property
    def _device(self) -> torch.device:
        tensors = list(self.kv.values()) or [self.state[next(iter(self.state))][0]]
        return tensors[0].device
