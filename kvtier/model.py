"""A model's KV cache as KV-cache groups: what each group holds, how it is keyed and laid out.

Hybrid models keep several kinds of per-token state side by side. kvtier describes a model as
a :class:`KVModel`: a name, a dtype and one :class:`KVCacheGroup` per *KV-cache group* (layers of
one kind that share a block table), in vLLM's group order. A group's kind says what its blocks
hold and, so, what a load needs (``docs/hybrid-models.md``):

* ``full_attention`` — K and V of every token (``[num_blocks, 2, block_size, heads, head_dim]``
  per layer). A load needs every chunk of the prefix.
* ``sliding_window`` — the same pages, but a layer attends only to the last ``sliding_window``
  tokens: a load needs only the chunks covering the window before the hit boundary, and a store
  writes only the chunks covering the window before the stored boundary.
* ``mla`` — one latent vector per token (``[num_blocks, block_size, latent_dim]`` per layer), the
  same on every TP rank (replicated, never sharded). Loaded as a prefix, like full attention.
* ``mamba`` — recurrent (Mamba / linear-attention) state: each block holds the state *after*
  its last token, as one tensor per entry of ``state_shapes`` (``[num_blocks, *shape]`` per layer).
  A load needs the one state at the hit boundary; a store writes the state at the stored boundary.

**Keys** (as vLLM builds them): block hashes are chained over ``hash_block_size`` tokens (the
greatest common divisor of the groups' block sizes); chunk ``i`` of group ``g`` covers
``chunk_tokens(g) = block_size_g * blocks_per_chunk`` tokens and is keyed by the hash ending at its
last token, followed by ``g`` (:func:`kvtier.keys.make_offload_key`).

**Host slots** are shared by every group and sized for the largest group chunk. A group chunk
is block-major, then layer, then the group's page (its parts one after the other, each at a
16-byte aligned offset): ``blocks_per_chunk`` blocks for attention and MLA groups, one block (the
state at the chunk's end) for a Mamba group. At ``tp_size > 1`` each rank of kvtier's engine holds
its own heads only: its slots, copies and chunk files follow :meth:`KVModel.rank_local` (the page
with ``num_kv_heads // tp_size`` heads, contiguous, nothing left for other ranks), and its chunk
files go to a tree of its own (:attr:`KVModel.parallel_agnostic`).

A :class:`kvtier.layout.KVGeometry` is the one-group case: :meth:`KVModel.of` turns it into a
model with one ``full_attention`` group and the same run fields, keys and host layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.layout import (
    DTYPE_ITEMSIZE,
    SLOT_ALIGNMENT,
    KVGeometry,
    check_model_revision,
    make_run_fields,
    normalize_dtype,
)

__all__ = [
    "GroupKind",
    "GROUP_KINDS",
    "PagePart",
    "KVCacheGroup",
    "KVModel",
    "layer_index",
]

GroupKind = Literal["full_attention", "sliding_window", "mla", "mamba"]
GROUP_KINDS: tuple[str, ...] = ("full_attention", "sliding_window", "mla", "mamba")
#: Parts of a page start at multiples of this many bytes (any element size divides it).
_PART_ALIGNMENT = 16
#: vLLM's name of each kind in KV events (``kv_cache_spec_kind``).
_EVENT_KIND: dict[str, str] = {
    "full_attention": "full_attention",
    "sliding_window": "sliding_window",
    "mla": "mla_attention",
    "mamba": "mamba",
}
_LAYER_INDEX = re.compile(r"\d+")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _shape(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a sequence of positive integers, got {value!r}")
    dims = tuple(value)
    if not dims:
        raise ConfigError(f"{name} must not be empty")
    for dim in dims:
        _positive(name, dim)
    return dims


def layer_index(name: str) -> int | None:
    """The first integer in a layer name (``model.layers.12.self_attn.attn`` → 12), or ``None``."""
    match = _LAYER_INDEX.search(name)
    return int(match.group()) if match else None


@dataclass(frozen=True, slots=True)
class PagePart:
    """One tensor's share of a page (one block of one layer of a group).

    ``shape`` is the part's shape over all TP ranks, ``dtype`` its canonical dtype name and
    ``offset`` its byte offset inside the page. ``shard_dim`` is the dimension of ``shape`` split
    evenly over the TP ranks (attention heads), ``None`` when every rank holds the whole part
    (MLA latents, recurrent state). ``legend`` names the dimensions for error messages.
    """

    shape: tuple[int, ...]
    dtype: str
    offset: int
    shard_dim: int | None
    legend: str

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def rank_shape(self, tp_size: int) -> tuple[int, ...]:
        """The part's shape on one of ``tp_size`` ranks."""
        if self.shard_dim is None:
            return self.shape
        dims = list(self.shape)
        dims[self.shard_dim] //= tp_size
        return tuple(dims)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV-cache group: its kind, block size in tokens, layers, and per-kind shape.

    Build one with the class methods :meth:`full_attention`, :meth:`sliding_window`, :meth:`mla`
    and :meth:`mamba`; the constructor validates (``ConfigError`` naming the field) whatever way
    it is called. ``dtype`` (attention and MLA groups) defaults to the model's.
    """

    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    num_kv_heads: int | None = None
    head_dim: int | None = None
    window: int | None = None
    latent_dim: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] | None = None
    state_dtypes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"group kind {self.kind!r} is not one of {', '.join(GROUP_KINDS)}")
        _positive("block_size", self.block_size)
        if isinstance(self.layer_names, (str, bytes)) or not isinstance(self.layer_names, Iterable):
            raise ConfigError(f"layer_names must be a sequence of layer names, got {self.layer_names!r}")
        names = tuple(self.layer_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"a {self.kind} group needs one or more non-empty layer names, got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"a {self.kind} group names a layer twice: {names!r}")
        object.__setattr__(self, "layer_names", names)
        attention = self.kind in ("full_attention", "sliding_window")
        required = {"full_attention": ("num_kv_heads", "head_dim"),
                    "sliding_window": ("num_kv_heads", "head_dim", "window"),
                    "mla": ("latent_dim",), "mamba": ("state_shapes", "state_dtypes")}[self.kind]
        for name in ("num_kv_heads", "head_dim", "window", "latent_dim", "state_shapes", "state_dtypes"):
            value = getattr(self, name)
            if name in required:
                if value is None:
                    raise ConfigError(f"a {self.kind} group needs {name}")
            elif value is not None:
                raise ConfigError(f"{name} does not apply to a {self.kind} group")
        if attention:
            _positive("num_kv_heads", self.num_kv_heads)
            _positive("head_dim", self.head_dim)
        if self.kind == "sliding_window":
            _positive("window", self.window)
        if self.kind == "mla":
            _positive("latent_dim", self.latent_dim)
        if self.kind == "mamba":
            assert self.state_shapes is not None and self.state_dtypes is not None
            if isinstance(self.state_shapes, (str, bytes)) or not isinstance(self.state_shapes, Iterable):
                raise ConfigError(f"state_shapes must be a sequence of shapes, got {self.state_shapes!r}")
            shapes = tuple(_shape(f"state_shapes[{i}]", s) for i, s in enumerate(self.state_shapes))
            if isinstance(self.state_dtypes, (str, bytes)) or not isinstance(self.state_dtypes, Iterable):
                raise ConfigError(f"state_dtypes must be a sequence of dtypes, got {self.state_dtypes!r}")
            dtypes = tuple(normalize_dtype(d) for d in self.state_dtypes)
            if not shapes or len(dtypes) != len(shapes):
                raise ConfigError(
                    f"a mamba group needs one dtype per state tensor: {len(shapes)} shapes, {len(dtypes)} dtypes"
                )
            object.__setattr__(self, "state_shapes", shapes)
            object.__setattr__(self, "state_dtypes", dtypes)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def full_attention(cls, *, block_size: int, layer_names: Sequence[str], num_kv_heads: int,
                       head_dim: int) -> KVCacheGroup:
        """Full-attention layers: K and V of every token."""
        return cls("full_attention", block_size, tuple(layer_names), num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def sliding_window(cls, *, window: int, block_size: int, layer_names: Sequence[str], num_kv_heads: int,
                       head_dim: int) -> KVCacheGroup:
        """Sliding-window attention layers that attend to the last ``window`` tokens."""
        return cls("sliding_window", block_size, tuple(layer_names), num_kv_heads=num_kv_heads,
                   head_dim=head_dim, window=window)

    @classmethod
    def mla(cls, *, block_size: int, layer_names: Sequence[str], latent_dim: int) -> KVCacheGroup:
        """Multi-head latent attention: one ``latent_dim`` vector per token, replicated on every rank."""
        return cls("mla", block_size, tuple(layer_names), latent_dim=latent_dim)

    @classmethod
    def mamba(cls, *, block_size: int, layer_names: Sequence[str], state_shapes: Sequence[Sequence[int]],
              state_dtypes: Sequence[Any]) -> KVCacheGroup:
        """Recurrent-state layers (Mamba, linear attention): per layer, one tensor per state shape.

        ``block_size`` is the state's alignment in tokens: a block holds the state after its
        last token.
        """
        return cls("mamba", block_size, tuple(layer_names),
                   state_shapes=tuple(tuple(s) for s in state_shapes), state_dtypes=tuple(state_dtypes))

    # ------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def is_attention(self) -> bool:
        """K/V pages (full or sliding-window attention)."""
        return self.kind in ("full_attention", "sliding_window")

    @property
    def event_kind(self) -> str:
        """The group's ``kv_cache_spec_kind`` in KV events (vLLM's names)."""
        return _EVENT_KIND[self.kind]

    @property
    def loads_prefix(self) -> bool:
        """A load needs every chunk of the prefix (full attention, MLA)."""
        return self.kind in ("full_attention", "mla")

    def parts(self, dtype: str) -> tuple[PagePart, ...]:
        """The parts of one page of this group, for a model of ``dtype``."""
        if self.is_attention:
            assert self.num_kv_heads is not None and self.head_dim is not None
            return (PagePart((2, self.block_size, self.num_kv_heads, self.head_dim), dtype, 0, 2,
                             "K/V, block_size, kv heads, head_dim"),)
        if self.kind == "mla":
            assert self.latent_dim is not None
            return (PagePart((self.block_size, self.latent_dim), dtype, 0, None, "block_size, latent_dim"),)
        assert self.state_shapes is not None and self.state_dtypes is not None
        parts = []
        offset = 0
        for i, (shape, state_dtype) in enumerate(zip(self.state_shapes, self.state_dtypes)):
            part = PagePart(shape, state_dtype, offset, None, f"state tensor {i}")
            parts.append(part)
            offset += -(-part.nbytes // _PART_ALIGNMENT) * _PART_ALIGNMENT
        return tuple(parts)

    def page_bytes(self, dtype: str) -> int:
        """Bytes of one page (one block of one layer), parts padded to 16-byte offsets."""
        parts = self.parts(dtype)
        end = parts[-1].offset + parts[-1].nbytes
        return end if len(parts) == 1 else -(-end // _PART_ALIGNMENT) * _PART_ALIGNMENT

    def blocks_per_slot(self, blocks_per_chunk: int) -> int:
        """Device blocks one chunk of this group copies: all of them, or the last (a state)."""
        return 1 if self.kind == "mamba" else blocks_per_chunk

    def describe(self) -> dict[str, Any]:
        """vLLM's ``kv_cache_groups`` entry for the run fields."""
        return {"tokens_per_block": self.block_size, "layer_names": list(self.layer_names)}


@dataclass(frozen=True, slots=True)
class KVModel:
    """A model's KV cache: its KV-cache groups, in vLLM's group order (module docstring).

    Validated on construction (``ConfigError``): at least one group, no layer in two groups, the
    parallel sizes positive, attention heads divisible by ``tp_size``, and no ``mamba`` group
    with ``tp_size > 1`` (a rank's state shard is not described here yet), ``model_revision``
    None or a printable one-line string of at most 256 characters. ``dtype`` is the attention and
    MLA dtype (state tensors carry their own). ``model_revision`` (which weights write the KV) is
    part of the run fields when set (:mod:`kvtier.layout`, "Compatibility manifest").
    """

    model_name: str
    dtype: str
    groups: tuple[KVCacheGroup, ...]
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    model_revision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")
        check_model_revision(self.model_revision)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("tp_size", "pp_size", "pcp_size", "dcp_size"):
            _positive(name, getattr(self, name))
        if isinstance(self.groups, KVCacheGroup) or not isinstance(self.groups, Iterable):
            raise ConfigError("groups must be a sequence of KVCacheGroup")
        groups = tuple(self.groups)
        if not groups:
            raise ConfigError("a model needs at least one KV-cache group")
        seen: dict[str, int] = {}
        for g, group in enumerate(groups):
            if not isinstance(group, KVCacheGroup):
                raise ConfigError(f"groups[{g}] is a {type(group).__name__}, expected a KVCacheGroup")
            for name in group.layer_names:
                if name in seen:
                    raise ConfigError(f"layer {name!r} is in groups {seen[name]} and {g}")
                seen[name] = g
            if group.is_attention and group.num_kv_heads % self.tp_size:  # type: ignore[operator]
                raise ConfigError(
                    f"group {g} ({group.kind}): num_kv_heads ({group.num_kv_heads}) must be divisible "
                    f"by tp_size ({self.tp_size})"
                )
            if group.kind == "mamba" and self.tp_size > 1:
                raise ConfigError(f"group {g} (mamba): recurrent state groups need tp_size 1, got {self.tp_size}")
        object.__setattr__(self, "groups", groups)

    @classmethod
    def of(cls, model: KVModel | KVGeometry) -> KVModel:
        """``model`` itself, or the one-group model of a :class:`KVGeometry` (its ``model_revision`` too)."""
        if isinstance(model, KVModel):
            return model
        if not isinstance(model, KVGeometry):
            raise TypeError(f"expected a kvtier.KVGeometry or kvtier.KVModel, got {type(model).__name__}")
        group = KVCacheGroup.full_attention(block_size=model.block_size, layer_names=model.names_of_layers,
                                            num_kv_heads=model.num_kv_heads, head_dim=model.head_dim)
        return cls(model.model_name, model.dtype, (group,), tp_size=model.tp_size, pp_size=model.pp_size,
                   pcp_size=model.pcp_size, dcp_size=model.dcp_size, model_revision=model.model_revision)

    # ------------------------------------------------------------------ geometry
    @property
    def hybrid(self) -> bool:
        """More than one group, or one that is not full attention."""
        return len(self.groups) > 1 or self.groups[0].kind != "full_attention"

    @property
    def hash_block_size(self) -> int:
        """Tokens per block hash: the GCD of the groups' block sizes."""
        return math.gcd(*(group.block_size for group in self.groups))

    @property
    def num_layers(self) -> int:
        return sum(group.num_layers for group in self.groups)

    def chunk_tokens(self, group: int, blocks_per_chunk: int) -> int:
        """Tokens one chunk of group ``group`` covers."""
        return self.groups[group].block_size * blocks_per_chunk

    def hashes_per_chunk(self, group: int, blocks_per_chunk: int) -> int:
        return self.chunk_tokens(group, blocks_per_chunk) // self.hash_block_size

    def chunk_bytes(self, group: int, blocks_per_chunk: int) -> int:
        """Bytes of one chunk of group ``group`` with every head (one rank's: :meth:`rank_local`'s)."""
        _positive("blocks_per_chunk", blocks_per_chunk)
        g = self.groups[group]
        return g.blocks_per_slot(blocks_per_chunk) * g.num_layers * g.page_bytes(self.dtype)

    def slot_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of a host slot of every head: the largest group chunk, rounded up to a multiple
        of 4096 (a rank's slot at ``tp_size > 1``: :meth:`rank_local`'s)."""
        size = max(self.chunk_bytes(g, blocks_per_chunk) for g in range(len(self.groups)))
        return -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT

    def layer_order(self) -> list[tuple[int, int]]:
        """``(group, layer in group)`` of every layer in model order.

        The order is that of the first integer in each layer name (vLLM's layer index), ties
        in group order; when a name carries no integer, the groups' layers one group after the
        other.
        """
        layers = [(g, i, name) for g, group in enumerate(self.groups) for i, name in enumerate(group.layer_names)]
        indices = [layer_index(name) for _, _, name in layers]
        if any(index is None for index in indices):
            return [(g, i) for g, i, _ in layers]
        order = sorted(range(len(layers)), key=lambda k: (indices[k], layers[k][0]))
        return [(layers[k][0], layers[k][1]) for k in order]

    # ------------------------------------------------------------------ namespace
    @property
    def parallel_agnostic(self) -> bool:
        """Whether the bytes a rank persists are topology-independent, so that every rank (and
        every TP size) shares one tree: one full-attention group at TP 1 (named as vLLM names
        that run), or one MLA group replicated over ``tp_size > 1`` ranks (vLLM's replicated
        layout: every rank holds the same latents; at TP 1 vLLM names the sizes). An attention
        model at ``tp_size > 1`` is not: each rank persists only its own heads
        (:meth:`rank_local`), so its run names its sizes and each rank gets a tree of its own
        (vLLM's ranks share one host region and write whole pages; kvtier's engine ranks are
        separate processes and do not). Hybrid models name their parallel sizes, as vLLM does
        for them."""
        if len(self.groups) != 1:
            return False
        kind = self.groups[0].kind
        if kind == "full_attention":
            return self.tp_size == 1
        return kind == "mla" and self.tp_size > 1

    def rank_local(self) -> KVModel:
        """The model as one TP rank of kvtier's engine holds its KV: every attention group with
        ``num_kv_heads // tp_size`` heads, ``tp_size`` 1 (MLA latents are whole on every rank;
        Mamba state needs ``tp_size`` 1). A rank's host slots, copies and chunk files are laid
        out by it: its own heads, contiguous, with no room left for other ranks' heads. Keys and
        run fields stay the whole model's (:meth:`run_fields`). The model itself at TP 1."""
        if self.tp_size == 1:
            return self
        groups = tuple(replace(group, num_kv_heads=group.num_kv_heads // self.tp_size)  # type: ignore[operator]
                       if group.is_attention else group for group in self.groups)
        return replace(self, groups=groups, tp_size=1)

    def run_fields(self, blocks_per_chunk: int, inference_engine: str = "kvtier", *,
                   namespace_tag: str | None = None) -> dict[str, Any]:
        """The run-configuration fields (vLLM's ``config.json`` fields) for this model.

        Every group is listed (``kv_cache_groups``); ``tokens_per_hash`` is the hash block size.
        Topology-independent models (:attr:`parallel_agnostic`) record parallel sizes 1 (and a
        replicated MLA group ``replicated_layout: true``); others their real sizes and
        ``parallel_agnostic: false``. ``model_revision`` and ``namespace_tag`` are added only
        when set: without them the fields are exactly vLLM's.
        """
        _positive("blocks_per_chunk", blocks_per_chunk)
        agnostic = self.parallel_agnostic
        fields = make_run_fields(self.model_name, self.hash_block_size, blocks_per_chunk,
                                 (self.tp_size, self.pp_size, self.pcp_size, self.dcp_size), self.dtype,
                                 [group.describe() for group in self.groups], inference_engine, agnostic,
                                 model_revision=self.model_revision, namespace_tag=namespace_tag)
        if agnostic and self.groups[0].kind == "mla":
            fields["replicated_layout"] = True
        return fields
