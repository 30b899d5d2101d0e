"""Content-addressed keys: chained block hashes, the ``NONE_HASH`` seed and offload keys.

The algorithm, precisely (byte-compatible with vLLM's prefix-caching hashes):

* **Serialization and digest.** ``hash_fn(obj)`` for each algorithm:

  - ``sha256``: SHA-256 (32 bytes) of ``pickle.dumps(obj, protocol=5)``;
  - ``sha256_cbor``: SHA-256 (32 bytes) of ``cbor2.dumps(obj, canonical=True)``;
  - ``xxhash``: xxh3-128 digest (16 bytes) of ``pickle.dumps(obj, protocol=5)``;
  - ``xxhash_cbor``: xxh3-128 digest (16 bytes) of ``cbor2.dumps(obj, canonical=True)``.

  Pickle is used **only to serialize for hashing** (so keys match the ones vLLM computes);
  nothing in kvtier ever unpickles, so no untrusted bytes reach ``pickle.loads``.

* **Seed.** The seed string is ``$PYTHONHASHSEED`` when that variable is present in the
  environment (even if empty, as ``os.getenv`` reports it); otherwise ``"vllm-none-hash"``
  for the SHA-256 family, and for the xxhash family a random ``os.urandom(32).hex()`` drawn
  once per process (keys then cannot be shared across processes; a warning is logged once).
  ``NONE_HASH = hash_fn(seed_string)``: the seed *string object* is serialized and hashed.

* **Chained block hash.** Tokens are cut into blocks of ``block_size``; only full blocks are
  hashed. ``hash_i = hash_fn((parent_i, tuple(tokens_of_block_i), extra_keys_i))`` where
  ``parent_0`` is ``NONE_HASH`` (or a caller-given parent hash) and ``parent_i = hash_{i-1}``;
  ``extra_keys_i`` is ``None`` or a tuple (see below). Because the hash is chained, ``hash_i``
  fingerprints the whole prefix up to the end of block ``i``.

* **Extra keys** (:class:`RequestExtraKeys`, vLLM 0.33's ``generate_block_hash_extra_keys``).
  Block ``i`` covers tokens ``[start, end)``; its entries, in this order:

  - ``("lora", lora_name, lora_path)`` on every block of a LoRA request;
  - ``("mm", identifier, offset - start)`` for each multimodal item whose placeholder tokens
    ``[offset, offset + length)`` overlap the block, in prompt order (the relative offset is
    negative for an item that began in an earlier block);
  - ``("cache_salt", salt)`` on block 0 only (the chain carries it into every later hash);
  - ``("prompt_embeds", sha256(raw bytes of prompt_embeds[start:end]))`` with prompt embeds.

  No entry: ``None`` (not an empty tuple), so a plain request hashes as without extra keys.

* **Offload key.** ``block_hash ‖ group_idx.to_bytes(4, "big")`` (unsigned). The key of chunk
  ``i`` (``hashes_per_chunk`` hash blocks per chunk) is the offload key of
  ``block_hashes[(i+1) * hashes_per_chunk - 1]``; only complete chunks have keys.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import cbor2
import xxhash

from kvtier.errors import ConfigError

__all__ = [
    "HASH_ALGORITHMS",
    "MultimodalItem",
    "RequestExtraKeys",
    "NO_EXTRA_KEYS",
    "DEFAULT_SEED",
    "GROUP_BYTES",
    "hash_function",
    "digest_size",
    "hash_seed",
    "none_hash",
    "BlockHasher",
    "make_offload_key",
    "split_offload_key",
    "chunk_keys",
]

logger = logging.getLogger(__name__)

#: The fixed seed string of the SHA-256 family when ``PYTHONHASHSEED`` is not set.
DEFAULT_SEED = "vllm-none-hash"
#: Bytes of the KV-cache group index appended to a block hash in an offload key.
GROUP_BYTES = 4
_MAX_GROUP = 2**32
# Pinned rather than HIGHEST_PROTOCOL so a future Python cannot silently change every key.
_PICKLE_PROTOCOL = 5


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_pickle(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}
_DIGEST_SIZES: dict[str, int] = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
#: The accepted values of ``algorithm`` (vLLM's ``--prefix-caching-hash-algo``).
HASH_ALGORITHMS: tuple[str, ...] = tuple(_HASH_FUNCTIONS)


def _check_algorithm(algorithm: str) -> str:
    if algorithm not in _HASH_FUNCTIONS:
        raise ConfigError(
            f"hash algorithm {algorithm!r} is not supported; allowed: {', '.join(HASH_ALGORITHMS)}"
        )
    return algorithm


def hash_function(algorithm: str = "sha256") -> Callable[[Any], bytes]:
    """The ``hash_fn(obj) -> bytes`` of ``algorithm`` (ConfigError if unknown)."""
    return _HASH_FUNCTIONS[_check_algorithm(algorithm)]


def digest_size(algorithm: str = "sha256") -> int:
    """Bytes of a block hash produced by ``algorithm`` (32 for SHA-256, 16 for xxh3-128)."""
    return _DIGEST_SIZES[_check_algorithm(algorithm)]


_random_seed: str | None = None
_random_seed_lock = threading.Lock()


def _process_random_seed() -> str:
    # One random seed per process, shared by xxhash and xxhash_cbor, drawn on first use.
    global _random_seed
    with _random_seed_lock:
        if _random_seed is None:
            _random_seed = os.urandom(32).hex()
            logger.warning(
                "PYTHONHASHSEED is not set: the xxhash block-hash seed is random for this "
                "process, so cached KV chunks cannot be shared with other processes; set "
                "PYTHONHASHSEED to the same value everywhere to share them"
            )
        return _random_seed


def hash_seed(algorithm: str = "sha256") -> str:
    """The effective seed string of ``algorithm`` in this process, read from the environment now.

    ``$PYTHONHASHSEED`` if present, else ``"vllm-none-hash"`` (SHA-256 family) or this process's
    random seed (xxhash family). p2p peers compare this string in their handshake.
    """
    _check_algorithm(algorithm)
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algorithm.startswith("sha256"):
        return DEFAULT_SEED
    return _process_random_seed()


_none_hash_cache: dict[tuple[str, str], bytes] = {}


def none_hash(algorithm: str = "sha256") -> bytes:
    """``NONE_HASH`` of ``algorithm``: ``hash_fn(hash_seed(algorithm))``, the first block's parent.

    The seed is re-read on every call (so a changed ``PYTHONHASHSEED`` takes effect); the digest
    is cached per ``(algorithm, seed)``.
    """
    seed = hash_seed(algorithm)
    cached = _none_hash_cache.get((algorithm, seed))
    if cached is None:
        cached = _HASH_FUNCTIONS[algorithm](seed)
        _none_hash_cache[(algorithm, seed)] = cached
    return cached


class BlockHasher:
    """Computes chained block hashes of token sequences (see the module docstring).

    The seed (and so ``NONE_HASH``) is resolved once, at construction: a hasher never changes
    its keys during its life even if the environment changes. Hashing is pure and thread-safe.
    """

    __slots__ = ("algorithm", "block_size", "seed", "none_hash", "digest_size", "_hash_fn")

    def __init__(self, algorithm: str = "sha256", block_size: int = 16) -> None:
        _check_algorithm(algorithm)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.algorithm = algorithm
        self.block_size = block_size
        self.seed = hash_seed(algorithm)
        self.none_hash = none_hash(algorithm)
        self.digest_size = _DIGEST_SIZES[algorithm]
        self._hash_fn = _HASH_FUNCTIONS[algorithm]

    def __repr__(self) -> str:
        # The seed is not secret, but it is long and noisy; the algorithm identifies the hasher.
        return f"BlockHasher(algorithm={self.algorithm!r}, block_size={self.block_size})"

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """One chained hash per *full* block of ``token_ids``; a trailing partial block is ignored.

        ``token_ids`` holds plain Python ints (numpy arrays and torch tensors are converted with
        ``.tolist()``, because pickling a numpy integer gives different bytes). ``extra_keys``
        is ``None`` or has one entry (a tuple or ``None``) per block; it must cover every full
        block, and entries beyond the last full block are ignored. ``parent`` continues a chain
        (the hash of the block just before ``token_ids[0]``); ``None`` starts one at
        ``NONE_HASH``. Raises ``ValueError`` on a parent of the wrong size or too few extra keys.
        """
        if not isinstance(token_ids, (list, tuple)):
            tolist = getattr(token_ids, "tolist", None)
            token_ids = tolist() if callable(tolist) else list(token_ids)
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        if parent is None:
            parent = self.none_hash
        elif not isinstance(parent, bytes) or len(parent) != self.digest_size:
            raise ValueError(f"parent must be a {self.digest_size}-byte {self.algorithm} hash")
        if extra_keys is not None and len(extra_keys) < num_blocks:
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries for {num_blocks} full blocks"
            )
        hash_fn = self._hash_fn
        hashes: list[bytes] = []
        append = hashes.append
        if extra_keys is None:
            for start in range(0, num_blocks * bs, bs):
                parent = hash_fn((parent, tuple(token_ids[start : start + bs]), None))
                append(parent)
        else:
            for i in range(num_blocks):
                start = i * bs
                parent = hash_fn((parent, tuple(token_ids[start : start + bs]), extra_keys[i]))
                append(parent)
        return hashes


class MultimodalItem(NamedTuple):
    """One multimodal input of a prompt: its placeholder tokens are ``[offset, offset + length)``.

    ``identifier`` is what vLLM keys the item by: ``MultiModalFeatureSpec.identifier`` (the
    item's content hash, prefixed with the LoRA name where vLLM adds one). A plain
    ``(identifier, offset, length)`` tuple is accepted wherever this is.
    """

    identifier: str
    offset: int
    length: int


def _plain_int(value: object, name: str) -> int:
    # A plain int: an int subclass or numpy integer would pickle to other bytes than vLLM's.
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _own_str(value: object, name: str) -> str:
    """``value`` as a non-empty plain str of its own (an empty one would key nothing apart).

    Plain: a str subclass pickles to other bytes. Of its own: pickle writes a string object met
    twice in one block's key as a back-reference, so equal strings that are one object (the same
    image twice in a block, passed as one variable) would hash differently from vLLM's, whose
    engine core receives every string as a separate object (decoded from msgpack).
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string")
    # A new object (one-character strings are shared singletons in every process anyway).
    return str(value[:1]) + str(value[1:])


def _mm_items(items: object) -> tuple[MultimodalItem, ...]:
    if items is None:
        return ()
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(
            f"mm_items must be a sequence of (identifier, offset, length), got {type(items).__name__}"
        )
    out: list[MultimodalItem] = []
    end = 0
    for i, item in enumerate(items):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 3:
            raise TypeError(f"mm_items[{i}] must be an (identifier, offset, length) triple, got {item!r}")
        identifier = _own_str(item[0], f"mm_items[{i}].identifier")
        offset = _plain_int(item[1], f"mm_items[{i}].offset")
        length = _plain_int(item[2], f"mm_items[{i}].length")
        if offset < 0 or length < 1:
            raise ValueError(f"mm_items[{i}]: offset must be >= 0 and length >= 1, got {offset}, {length}")
        if offset < end:
            # vLLM walks the items in this order and assumes they do not overlap.
            raise ValueError(
                f"mm_items[{i}] starts at token {offset}, inside the previous item (which ends at "
                f"{end}); items must be in prompt order and must not overlap"
            )
        end = offset + length
        out.append(MultimodalItem(identifier, offset, length))
    return tuple(out)


@dataclass(frozen=True, slots=True, eq=False)
class RequestExtraKeys:
    """What, besides its tokens, keys a request's blocks: the inputs of the extra keys.

    Constructing one validates every field (``TypeError`` / ``ValueError`` naming it):

    * ``cache_salt``: a non-empty str isolating a tenant; it enters block 0's hash only, and
      through the chain every later one.
    * ``lora_name`` and ``lora_path``: the LoRA adapter, both non-empty strs or both ``None``
      (vLLM keys a LoRA request by name *and* path, and requires the path).
    * ``mm_items``: :class:`MultimodalItem` triples (or plain tuples) in prompt order, not
      overlapping, ``offset >= 0``, ``length >= 1``.
    * ``prompt_embeds``: ``None`` or the request's 2-D prompt-embeddings tensor (rows are token
      positions); each block's entry hashes the raw bytes of its rows, as vLLM does (dtype and
      values matter, device and strides do not).

    :meth:`per_block` derives the per-block ``extra_keys`` of :meth:`BlockHasher.hash_blocks`.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm_items: Sequence[tuple[str, int, int]] | None = ()  # stored as a tuple of MultimodalItem
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        for name in ("cache_salt", "lora_name", "lora_path"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _own_str(value, name))
        if (self.lora_name is None) != (self.lora_path is None):
            raise ValueError(
                "lora_name and lora_path go together: vLLM keys a LoRA request by the adapter's "
                f"name and path (got lora_name={self.lora_name!r}, lora_path={self.lora_path!r})"
            )
        object.__setattr__(self, "mm_items", _mm_items(self.mm_items))
        if self.prompt_embeds is not None:
            import torch

            if not isinstance(self.prompt_embeds, torch.Tensor) or self.prompt_embeds.ndim != 2:
                shape = getattr(self.prompt_embeds, "shape", None)
                raise TypeError(
                    "prompt_embeds must be a 2-D torch.Tensor (tokens x hidden), got "
                    f"{type(self.prompt_embeds).__name__}{'' if shape is None else tuple(shape)}"
                )

    @property
    def empty(self) -> bool:
        """True when no block gets an extra key (the request hashes as plain tokens)."""
        return (self.cache_salt is None and self.lora_name is None and not self.mm_items
                and self.prompt_embeds is None)

    def per_block(self, num_blocks: int, block_size: int) -> list[tuple[Any, ...] | None] | None:
        """The extra keys of blocks ``0 .. num_blocks - 1`` (module docstring); ``None`` if empty."""
        if self.empty:
            return None
        lora: list[tuple[Any, ...]] = (
            [] if self.lora_name is None else [("lora", self.lora_name, self.lora_path)]
        )
        embeds = None
        if self.prompt_embeds is not None:
            embeds = self.prompt_embeds.detach().cpu()
        # (identifier, first token, end token) of each item, in prompt order
        spans = [(identifier, offset, offset + length) for identifier, offset, length in self.mm_items or ()]
        first_span = 0  # the spans before it end at or before the current block's start
        out: list[tuple[Any, ...] | None] = []
        for i in range(num_blocks):
            start = i * block_size
            end = start + block_size
            entries = list(lora)
            while first_span < len(spans) and spans[first_span][2] <= start:
                first_span += 1
            j = first_span
            while j < len(spans) and spans[j][1] < end:  # overlaps [start, end)
                entries.append(("mm", spans[j][0], spans[j][1] - start))
                j += 1
            if i == 0 and self.cache_salt is not None:
                entries.append(("cache_salt", self.cache_salt))
            if embeds is not None:
                entries.append(("prompt_embeds", _embeds_digest(embeds[start:end])))
            out.append(tuple(entries) if entries else None)
        return out


def _embeds_digest(rows: Any) -> bytes:
    import torch

    # The raw bytes of the rows in row-major order: what vLLM hashes (always SHA-256).
    raw = rows.contiguous().flatten().view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).digest()


#: The extra-key inputs of a plain request (no salt, no LoRA, no multimodal items, no embeds).
NO_EXTRA_KEYS = RequestExtraKeys()


def _check_group(group_idx: int) -> None:
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise TypeError(f"group_idx must be an int, got {type(group_idx).__name__}")
    if not 0 <= group_idx < _MAX_GROUP:
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> bytes:
    """``block_hash ‖ group_idx`` as 4 big-endian unsigned bytes (``0 <= group_idx < 2**32``)."""
    if not isinstance(block_hash, bytes) or not block_hash:
        raise TypeError("block_hash must be non-empty bytes")
    _check_group(group_idx)
    return block_hash + group_idx.to_bytes(GROUP_BYTES, "big")


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """Inverse of :func:`make_offload_key`: ``(block_hash, group_idx)``."""
    if not isinstance(key, bytes) or len(key) <= GROUP_BYTES:
        raise ValueError(f"an offload key is a non-empty hash plus {GROUP_BYTES} group bytes")
    return key[:-GROUP_BYTES], int.from_bytes(key[-GROUP_BYTES:], "big")


def chunk_keys(block_hashes: Sequence[bytes], hashes_per_chunk: int, group_idx: int = 0) -> list[bytes]:
    """Offload keys of the complete chunks covered by ``block_hashes``.

    Chunk ``i`` is keyed by the hash of its last block, ``block_hashes[(i+1)*hashes_per_chunk - 1]``,
    which (the hash being chained) fingerprints the whole prefix up to the chunk's end.
    """
    if isinstance(hashes_per_chunk, bool) or not isinstance(hashes_per_chunk, int) or hashes_per_chunk <= 0:
        raise ValueError(f"hashes_per_chunk must be a positive int, got {hashes_per_chunk!r}")
    _check_group(group_idx)
    suffix = group_idx.to_bytes(GROUP_BYTES, "big")
    return [
        block_hashes[end] + suffix
        for end in range(hashes_per_chunk - 1, len(block_hashes), hashes_per_chunk)
    ]
