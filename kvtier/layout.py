"""KV byte geometry, the run digest and the chunk namespace.

**Host layout.** A *page* is one block of one layer: ``page_shape = (2, block_size,
num_kv_heads, head_dim)`` (K/V, token, head, dim), exactly a per-layer device block at TP 1, so a
TP-1 copy is a plain memcpy. A chunk (one host slot) is block-major, then layer: page ``(b, l)``
sits at ``(b * num_layers + l) * page_bytes``; the slot is padded with zeros up to
``slot_bytes`` (a multiple of 4096). These sizes are of every head; at ``tp_size > 1`` a rank of
kvtier's engine holds its own heads only, in pages of ``num_kv_heads // tp_size`` heads laid out
the same way (:meth:`kvtier.model.KVModel.rank_local`, ``Engine.slot_bytes``).

**Namespace** (the names vLLM's file mapper gives, so that both read each other's trees).
``run_fields`` lists what makes persisted bytes compatible (model, hash granularity, chunk size,
parallelism, dtype, layers); ``run_digest`` names them in 12 hex chars; ``namespace`` turns that
into directory names and chunk paths::

    <root>/<model>_<digest>/                                     the run (the fs tier keeps config.json here)
    <root>/<model>_<digest>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin

**Compatibility manifest.** Two optional fields extend the run fields: ``model_revision`` (which
weights of the model wrote the KV) and ``namespace_tag`` (a free label). Each is added only when
set (:func:`make_run_fields`): absent, the fields, digest and names are exactly vLLM's; present,
the digest differs, so a run of another revision or tag lives in other directories (other object
keys) and its chunks, whose trailers record the fingerprint of these fields, are never read.

Paths are built with plain ``"/"`` string joins, never from the OS: the same strings serve as
object-store keys. With ``root == ""`` they are relative (``<model>_<digest>/...``); the obj tier
decides its own prefixing. The fs tier recognises these names, and gives the others of its tree,
in :mod:`kvtier.tiers.fs.tree`.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.keys import GROUP_BYTES, split_offload_key

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "SLOT_ALIGNMENT",
    "DTYPE_ITEMSIZE",
    "KVGeometry",
    "Namespace",
    "normalize_dtype",
    "torch_dtype",
    "make_run_fields",
    "MANIFEST_FIELDS",
    "check_model_revision",
    "check_namespace_tag",
    "with_manifest",
    "manifest_of",
    "run_digest",
    "run_fingerprint",
    "namespace",
]

#: Host slots are rounded up to this many bytes (page-aligned for O_DIRECT and pinned copies).
SLOT_ALIGNMENT = 4096

#: Canonical dtype name → bytes per element.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
_DTYPE_ALIASES: dict[str, str] = {
    "half": "float16",
    "float": "float32",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
_TORCH_DTYPE_NAMES: dict[str, str] = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    # fp8 pages are moved as raw bytes; uint8 storage keeps that independent of torch's fp8 support.
    "fp8": "uint8",
    "fp8_e4m3": "uint8",
    "fp8_e5m2": "uint8",
}
# A file-name segment is at most 255 bytes on common filesystems; leave room for "_<digest>_r<rank>".
_MAX_MODEL_NAME_BYTES = 200
_DIGEST_CHARS = 12
#: The run fields of the compatibility manifest, each present only when set.
MANIFEST_FIELDS: tuple[str, ...] = ("model_revision", "namespace_tag")
_MAX_REVISION_CHARS = 256
_NAMESPACE_TAG = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_model_revision(value: object, key: str = "model_revision") -> str | None:
    """``value`` if it is a valid model revision (None, or a non-empty printable one-line string of
    at most 256 characters: a commit hash, a tag, a date); ConfigError naming ``key`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: {value!r} is invalid; expected a non-empty string or None")
    if len(value) > _MAX_REVISION_CHARS:
        raise ConfigError(f"{key}: {len(value)} characters; at most {_MAX_REVISION_CHARS} are allowed")
    if not value.isprintable():  # NUL, newlines and other control characters
        raise ConfigError(f"{key}: {value!r} is invalid; it must be printable, on one line")
    return value


def check_namespace_tag(value: object, key: str = "namespace_tag") -> str | None:
    """``value`` if it is a valid namespace tag (None, or 1 to 64 of ``A-Z a-z 0-9 . _ -``);
    ConfigError naming ``key`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or _NAMESPACE_TAG.fullmatch(value) is None:
        raise ConfigError(
            f"{key}: {value!r} is invalid; expected 1 to 64 letters, digits, '.', '_' or '-', or None"
        )
    return value


def normalize_dtype(dtype: object) -> str:
    """Canonical dtype name (``"torch."`` prefix removed, aliases resolved); ConfigError if unknown.

    Accepts strings such as ``"half"``, ``"torch.bfloat16"``, ``"fp8_e4m3"`` and torch dtypes.
    """
    name = str(dtype).strip().lower()
    name = name.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_ITEMSIZE:
        raise ConfigError(
            f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPE_ITEMSIZE)} "
            f"(aliases: {', '.join(_DTYPE_ALIASES)})"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype pages of canonical dtype ``name`` are viewed as (fp8 → ``torch.uint8`` storage)."""
    import torch  # deferred: importing kvtier must not import torch

    dtype: torch.dtype = getattr(torch, _TORCH_DTYPE_NAMES[name])
    return dtype


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The shape of one model's KV cache, and the byte layout kvtier derives from it.

    Validated on construction (ConfigError): sizes positive, ``num_kv_heads`` divisible by
    ``tp_size``, ``dtype`` known (stored normalized, e.g. ``"torch.half"`` → ``"float16"``),
    ``layer_names`` (default ``model.layers.{i}.self_attn.attn``) one per layer,
    ``model_revision`` None or a printable one-line string of at most 256 characters (which weights
    write the KV: part of the run fields when set, module docstring).
    """

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    layer_names: tuple[str, ...] | None = field(default=None)
    model_revision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")
        check_model_revision(self.model_revision)
        for name in (
            "num_layers", "num_kv_heads", "head_dim", "block_size",
            "tp_size", "pp_size", "pcp_size", "dcp_size",
        ):
            _check_positive(name, getattr(self, name))
        if self.num_kv_heads % self.tp_size:
            raise ConfigError(
                f"num_kv_heads ({self.num_kv_heads}) must be divisible by tp_size ({self.tp_size})"
            )
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.layer_names is not None:
            names = tuple(self.layer_names)
            if len(names) != self.num_layers or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(
                    f"layer_names must hold {self.num_layers} non-empty strings, got {len(names)}"
                )
            object.__setattr__(self, "layer_names", names)

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype host and device pages are viewed as (fp8 → ``torch.uint8`` storage)."""
        return torch_dtype(self.dtype)

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """``(2, block_size, num_kv_heads, head_dim)``: K/V, token, head, dim."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: one block of one layer, K and V, all heads."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers and heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def names_of_layers(self) -> tuple[str, ...]:
        """``layer_names`` or the default ``model.layers.{i}.self_attn.attn`` names."""
        if self.layer_names is not None:
            return self.layer_names
        return tuple(f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers))

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Payload bytes of one chunk: ``blocks_per_chunk * num_layers * page_bytes``."""
        _check_positive("blocks_per_chunk", blocks_per_chunk)
        return blocks_per_chunk * self.num_layers * self.page_bytes

    def slot_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of a host slot of every head: :meth:`chunk_bytes` rounded up to a multiple of
        4096 (at ``tp_size > 1`` a rank's slot holds its own heads: ``Engine.slot_bytes``)."""
        size = self.chunk_bytes(blocks_per_chunk)
        return -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT

    def page_offset(self, block_in_chunk: int, layer: int) -> int:
        """Byte offset of page ``(block_in_chunk, layer)`` inside a slot (block-major, then layer)."""
        if block_in_chunk < 0:
            raise ValueError(f"block_in_chunk must be >= 0, got {block_in_chunk}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return (block_in_chunk * self.num_layers + layer) * self.page_bytes

    def run_fields(
        self,
        blocks_per_chunk: int,
        inference_engine: str = "kvtier",
        parallel_agnostic: bool | None = None,
        *,
        namespace_tag: str | None = None,
    ) -> dict[str, Any]:
        """The run-configuration fields, input of :func:`run_digest` (vLLM's ``config.json`` fields).

        In parallelism-agnostic mode (every rank's bytes are the same: one tree for all) the
        parallel sizes are 1 and ``parallel_agnostic`` is absent; otherwise they are the real
        sizes and ``parallel_agnostic`` is ``False``. The default is what kvtier's engine uses
        (:attr:`kvtier.model.KVModel.parallel_agnostic`): agnostic at ``tp_size`` 1 only, since
        at ``tp_size > 1`` each rank persists its own heads. ``model_revision`` and
        ``namespace_tag`` are added when set (:func:`with_manifest`).
        """
        _check_positive("blocks_per_chunk", blocks_per_chunk)
        if parallel_agnostic is None:
            parallel_agnostic = self.tp_size == 1
        groups = [{"tokens_per_block": self.block_size, "layer_names": list(self.names_of_layers)}]
        return make_run_fields(self.model_name, self.block_size, blocks_per_chunk,
                               (self.tp_size, self.pp_size, self.pcp_size, self.dcp_size), self.dtype, groups,
                               inference_engine, parallel_agnostic,
                               model_revision=self.model_revision, namespace_tag=namespace_tag)


def make_run_fields(model_name: str, tokens_per_hash: int, blocks_per_chunk: int,
                    parallel_sizes: tuple[int, int, int, int], dtype: str, kv_cache_groups: list[dict[str, Any]],
                    inference_engine: str, parallel_agnostic: bool, *, model_revision: str | None = None,
                    namespace_tag: str | None = None) -> dict[str, Any]:
    """The run-configuration fields (vLLM's ``config.json`` fields) of a run.

    ``parallel_sizes`` are ``(tp, pp, pcp, dcp)``. In parallelism-agnostic mode they are recorded
    as 1 and ``parallel_agnostic`` is absent; otherwise they are the real sizes and
    ``parallel_agnostic`` is ``False``. The manifest fields are added as :func:`with_manifest`
    adds them: only when set.
    """
    tp, pp, pcp, dcp = (1, 1, 1, 1) if parallel_agnostic else parallel_sizes
    fields: dict[str, Any] = {
        "model_name": model_name,
        "tokens_per_hash": tokens_per_hash,
        "blocks_per_file": blocks_per_chunk,
        "tp_size": tp,
        "pp_size": pp,
        "pcp_size": pcp,
        "dcp_size": dcp,
        "dtype": dtype,
        "kv_cache_groups": kv_cache_groups,
        "inference_engine": inference_engine,
    }
    if not parallel_agnostic:
        fields["parallel_agnostic"] = False
    return with_manifest(fields, model_revision=model_revision, namespace_tag=namespace_tag)


def with_manifest(fields: Mapping[str, Any], *, model_revision: str | None = None,
                  namespace_tag: str | None = None) -> dict[str, Any]:
    """A copy of run ``fields`` with ``model_revision`` and ``namespace_tag`` added where they are
    not None (validated: ConfigError naming the field). With both None the copy equals ``fields``:
    the digest and names stay vLLM's exact ones."""
    out = dict(fields)
    for name, value in (("model_revision", check_model_revision(model_revision)),
                        ("namespace_tag", check_namespace_tag(namespace_tag))):
        if value is not None:
            out[name] = value
    return out


def manifest_of(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The compatibility manifest recorded in run ``fields``: ``{"model": model_name,
    "model_revision": str | None, "namespace_tag": str | None}`` (None where the field is absent;
    both None: the vLLM-compatible namespace)."""
    manifest: dict[str, Any] = {"model": fields.get("model_name")}
    for name in MANIFEST_FIELDS:
        value = fields.get(name)
        manifest[name] = value if value is None or isinstance(value, str) else str(value)
    return manifest


def _canonical_json(fields: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"run fields must be JSON-serializable: {exc}") from None


def run_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """SHA-256 over the UTF-8 of the sorted, compact JSON of ``fields`` (all 32 bytes).

    Chunk trailers record it (:mod:`kvtier.tiers.integrity`), so a chunk proves which run wrote it
    even where the 12-character :func:`run_digest` of the directory name could collide.
    """
    return hashlib.sha256(_canonical_json(fields).encode("utf-8")).digest()


def run_digest(fields: Mapping[str, Any]) -> str:
    """First 12 lowercase hex chars of SHA-256 over the UTF-8 of the sorted, compact JSON of ``fields``."""
    return run_fingerprint(fields).hex()[:_DIGEST_CHARS]


def _check_path_text(what: str, text: str) -> None:
    if "\x00" in text or "\\" in text:
        raise ConfigError(f"{what} must not contain NUL bytes or backslashes: {text!r}")
    if ".." in text.split("/"):
        raise ConfigError(f"{what} must not contain '..' path segments: {text!r}")


def _model_segment(model_name: object) -> str:
    """The model's directory-name part: every ``/`` replaced by ``_``, as vLLM's FileMapper does.

    The result is one path segment whatever the name (``/models/x`` -> ``_models_x``, which is
    how vLLM names a local model), so only what no file name can hold is refused: NUL bytes, and
    names too long for a directory entry.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError(f"run fields need a non-empty string model_name, got {model_name!r}")
    if "\x00" in model_name:
        raise ConfigError(f"model_name must not contain NUL bytes: {model_name!r}")
    if len(model_name.encode("utf-8")) > _MAX_MODEL_NAME_BYTES:
        raise ConfigError(f"model_name is longer than {_MAX_MODEL_NAME_BYTES} bytes")
    return model_name.replace("/", "_")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Directory names and chunk paths of one run configuration (see the module docstring).

    ``base_dir`` is the run's directory; chunk files live under the sibling ``blocks_dir``
    (``<base_dir>_r<rank>``). Build with :func:`namespace`.
    """

    root: str
    digest: str
    rank: int
    base_dir: str
    blocks_dir: str
    fields: Mapping[str, Any] = field(compare=False, repr=False)
    #: What chunk trailers record: ``SHA-256(run_fingerprint(fields) || rank.to_bytes(8, "big"))``
    #: (the rank of the tree, 0 where ranks share one), so a chunk of one rank's tree (its shard of the KV heads) never passes as
    #: another's, and no chunk passes between runs.
    fingerprint: bytes = field(default=b"", compare=False, repr=False)

    @property
    def leaf(self) -> str:
        """The name of ``base_dir`` inside ``root`` (``<model>_<digest>``)."""
        return self.base_dir.rsplit("/", 1)[-1]

    @property
    def blocks_leaf(self) -> str:
        """The name of ``blocks_dir`` inside ``root`` (``<model>_<digest>_r<rank>``)."""
        return self.blocks_dir.rsplit("/", 1)[-1]

    @staticmethod
    def chunk_relpath(key: bytes) -> str:
        """``<h[0:3]>/<h[3:5]>_g<group>/<h>.bin`` for offload key ``key`` (``h`` = hash hex)."""
        # split_offload_key, inline: this runs for every chunk loaded or stored.
        if not isinstance(key, bytes) or len(key) < GROUP_BYTES + 3:
            split_offload_key(key)  # raises for what is no offload key at all
            raise ValueError("a chunk hash needs at least 3 bytes to be sharded into directories")
        h = key[:-GROUP_BYTES].hex()
        return f"{h[0:3]}/{h[3:5]}_g{int.from_bytes(key[-GROUP_BYTES:], 'big')}/{h}.bin"

    @staticmethod
    def chunk_relpaths(keys: Sequence[bytes]) -> list[bytes]:
        """``[chunk_relpath(key).encode() for key in keys]``, with the same errors, in fewer
        steps per key when the keys have one length and one group (a job's keys do): a loader
        makes these for every chunk, under the interpreter lock its peers wait on."""
        if not keys:
            return []
        width = len(keys[0])
        if (width < GROUP_BYTES + 3 or set(map(type, keys)) != {bytes} or set(map(len, keys)) != {width}
                or len({key[-GROUP_BYTES:] for key in keys}) != 1):
            return [Namespace.chunk_relpath(key).encode() for key in keys]
        # One hexadecimal string for all keys, cut into each path's pieces by one struct.
        pieces = _hex_pieces(width)
        path = b"%%b/%%b_g%d/%%b%%b%%b.bin" % int.from_bytes(keys[0][-GROUP_BYTES:], "big")
        return [path % (top, leaf, top, leaf, rest) for top, leaf, rest in pieces.iter_unpack(binascii.hexlify(b"".join(keys)))]

    def chunk_path(self, key: bytes) -> str:
        """``<blocks_dir>/<chunk_relpath(key)>``."""
        return f"{self.blocks_dir}/{self.chunk_relpath(key)}"


@functools.lru_cache(maxsize=8)
def _hex_pieces(width: int) -> struct.Struct:
    """The struct that cuts the hexadecimal digits of one ``width``-byte key into a chunk path's
    pieces (:meth:`Namespace.chunk_relpaths`): the top directory's 3, the leaf's 2, the rest of
    the hash's, and the group's (skipped)."""
    return struct.Struct(f"3s2s{2 * (width - GROUP_BYTES) - 5}s{2 * GROUP_BYTES}x")


def namespace(root: str, fields: Mapping[str, Any], rank: int) -> Namespace:
    """The :class:`Namespace` of run ``fields`` under ``root`` for worker ``rank``.

    ``base_dir = <root>/<model with "/" → "_">_<digest>`` (or without ``<root>/`` when ``root``
    is ``""``); ``blocks_dir = <base_dir>_r<rank>``, with the rank forced to 0 when the fields
    are parallelism-agnostic (no ``parallel_agnostic`` key): all ranks then share one tree.
    ConfigError when the root could escape (``..`` segments, NUL bytes, backslashes), the model
    name holds a NUL byte or is too long, or the fields are not JSON-serializable.
    """
    if not isinstance(root, str):
        raise ConfigError(f"root must be a string, got {type(root).__name__}")
    if root:
        _check_path_text("root", root)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"rank must be a non-negative integer, got {rank!r}")
    model = _model_segment(fields.get("model_name"))
    fingerprint = run_fingerprint(fields)
    digest = fingerprint.hex()[:_DIGEST_CHARS]
    if "parallel_agnostic" not in fields:
        rank = 0
    tree_fingerprint = hashlib.sha256(fingerprint + rank.to_bytes(8, "big")).digest()
    leaf = f"{model}_{digest}"
    base_dir = f"{root}/{leaf}" if root else leaf
    frozen_fields = json.loads(_canonical_json(fields))  # a private deep copy
    return Namespace(
        root=root,
        digest=digest,
        rank=rank,
        base_dir=base_dir,
        blocks_dir=f"{base_dir}_r{rank}",
        fields=frozen_fields,
        fingerprint=tree_fingerprint,
    )
