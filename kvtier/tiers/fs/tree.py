"""The fs tier's tree on disk: every name it writes or recognises under ``root_dir``, ``config.json``,
and the limits on both. The tier, its scans and the operator commands all take them from here::

    <root_dir>/<model>_<digest>/config.json                     the run's fields (JSON object, ≤ 1 MiB)
    <root_dir>/<model>_<digest>/config.json_<n>.tmp             a first start publishing it
    <root_dir>/<model>_<digest>_r<rank>/                         one rank's tree (``blocks_dir``)
        .kvtier_odirect_probe_<n>                                the O_DIRECT probe of a start-up
        <hhh>/<hh>_g<group>/<hash>.bin                           a chunk file
        <hhh>/<hh>_g<group>/<hash>.bin_<n>.tmp                   a chunk file being written

``<n>`` is a random decimal of at most 20 digits, ``<hash>`` the chunk's block hash in lowercase
hex (at least 3 bytes), ``<hhh>`` and ``<hh>`` its first five hex digits (4096 *top* directories,
256 *leaf* directories per top and group). The run and rank directory names and each chunk's
relative path are built by :func:`kvtier.layout.namespace` (the obj tier names its objects with
the same strings); this module recognises them, strictly: a name it does not recognise was not
written by kvtier.

Semantics callers rely on:

* ``config.json`` is published once, atomically (:func:`ensure_config_json`): readers see no
  file or a complete one, and concurrent first starts never overwrite each other.
* Nothing here follows a symbolic link below ``root_dir`` (:mod:`kvtier.tiers.fs.beneath`).
* Importing this module imports nothing heavy of kvtier's: scan worker processes use it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tiers.fs import beneath
from kvtier.tiers.fs.modes import PRIVATE, Modes

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.layout import Namespace

__all__ = [
    "CONFIG_JSON",
    "MAX_CONFIG_JSON_BYTES",
    "CONFIG_TMP",
    "ConfigJsonTooLarge",
    "ConfigJsonNotObject",
    "config_path",
    "config_text",
    "open_config_json",
    "read_config_bytes",
    "decode_config_json",
    "ensure_config_json",
    "RUN_DIR",
    "TREE_DIR",
    "TOPS",
    "LEAVES_PER_TOP",
    "MAX_KEY_BYTES",
    "TOP_DIR",
    "LEAF_DIR",
    "CHUNK_FILE",
    "CHUNK_TMP",
    "PROBE_PREFIX",
    "PROBE_NAME",
    "chunk_tmp_name",
    "probe_name",
    "parse_leaf_name",
    "chunk_key",
    "key_from_relpath",
    "leaf_of",
    "leaf_relpath",
    "chunk_name",
]

# --- under root_dir ---------------------------------------------------------------------------

CONFIG_JSON = "config.json"
#: A larger ``config.json`` is refused unread: run fields are a few KiB.
MAX_CONFIG_JSON_BYTES = 1 << 20
CONFIG_TMP = re.compile(r"config\.json_[0-9]{1,20}\.tmp")
#: A run directory ``<model>_<digest>`` (12 hex chars: :func:`kvtier.layout.run_digest`).
RUN_DIR = re.compile(r"(.+)_([0-9a-f]{12})")
#: A rank tree ``<model>_<digest>_r<rank>``: the run directory's name, then the rank.
TREE_DIR = re.compile(r"(.+_[0-9a-f]{12})_r(0|[1-9][0-9]{0,9})")

# --- inside a rank tree -----------------------------------------------------------------------

TOPS = 4096  # top directories <hhh>
LEAVES_PER_TOP = 256  # leaf directories <hh>_g<group> per top directory, per group
#: Longest offload key a chunk file name may give: a SHA-256 block hash plus the 4-byte group
#: index (what the fs tier's index stores).
MAX_KEY_BYTES = 36
_TOP = r"[0-9a-f]{3}"
_LEAF = r"([0-9a-f]{2})_g(0|[1-9][0-9]{0,9})"
_HASH = r"(?:[0-9a-f]{2}){3,}"
TOP_DIR = re.compile(_TOP)
LEAF_DIR = re.compile(_LEAF)
CHUNK_FILE = re.compile(rf"({_HASH})\.bin")
CHUNK_TMP = re.compile(r"[0-9a-f]{6,}\.bin_[0-9]{1,20}\.tmp")
PROBE_PREFIX = ".kvtier_odirect_probe"
PROBE_NAME = re.compile(re.escape(PROBE_PREFIX) + r"_[0-9]{1,20}")
_RELPATH = re.compile(rf"({_TOP})/{_LEAF}/({_HASH})\.bin")
_LEAF_NAMES: dict[str, tuple[int, int]] = {}


def config_path(ns: Namespace) -> str:
    """``<config_dir>/config.json`` of run namespace ``ns`` (its ``base_dir``)."""
    return f"{ns.base_dir}/{CONFIG_JSON}"


def config_text(ns: Namespace) -> str:
    """Contents of ``config.json``: the run fields, 2-space indent, sorted keys."""
    return json.dumps(dict(ns.fields), indent=2, sort_keys=True)


def chunk_tmp_name(name: str) -> str:
    """A unique temporary name beside chunk file ``name`` (matches :data:`CHUNK_TMP`)."""
    return f"{name}_{secrets.randbits(63)}.tmp"


def probe_name() -> str:
    """A unique O_DIRECT probe file name (matches :data:`PROBE_NAME`)."""
    return f"{PROBE_PREFIX}_{secrets.randbits(63)}"


def parse_leaf_name(name: str) -> tuple[int, int] | None:
    """``(second-level shard, group)`` of a leaf directory name ``<hh>_g<group>``; None if it is
    not one. Parsed names are remembered: trees repeat the same few hundred."""
    parsed = _LEAF_NAMES.get(name)
    if parsed is not None:
        return parsed
    match = LEAF_DIR.fullmatch(name)
    if match is None or int(match.group(2)) >= 2**32:
        return None
    parsed = int(match.group(1), 16), int(match.group(2))
    if len(_LEAF_NAMES) < 1 << 16:
        _LEAF_NAMES[name] = parsed
    return parsed


def chunk_key(name: str, top: str, leaf_hex: str, group: int | bytes) -> bytes | None:
    """The offload key of chunk file ``name`` in leaf ``<top>/<leaf_hex>_g<group>`` (``group`` may
    be given as its 4 key bytes); None when the name is not a chunk of that directory or gives a
    key longer than :data:`MAX_KEY_BYTES`. The name is ``key[:-4].hex() + ".bin"``."""
    match = CHUNK_FILE.fullmatch(name)
    if match is None:
        return None
    h = match.group(1)
    if h[0:3] != top or h[3:5] != leaf_hex or len(h) // 2 + 4 > MAX_KEY_BYTES:
        return None
    return bytes.fromhex(h) + (group if isinstance(group, bytes) else group.to_bytes(4, "big"))


def key_from_relpath(relpath: str) -> bytes | None:
    """The offload key whose chunk path (:meth:`kvtier.layout.Namespace.chunk_relpath`) is
    ``relpath``; ``None`` if malformed.

    Strict: lowercase hex only, shard directories must match the hash, the group must be a
    canonical decimal below 2**32, and nothing else (no ``./``, no extra segments) is allowed.
    Unlike :func:`chunk_key`, the hash may be of any length.
    """
    match = _RELPATH.fullmatch(relpath)
    if match is None:
        return None
    top, leaf_hex, group_text, h = match.groups()
    group = int(group_text)
    if h[0:3] != top or h[3:5] != leaf_hex or group >= 2**32:
        return None
    return bytes.fromhex(h) + group.to_bytes(4, "big")


def leaf_of(key: bytes) -> tuple[int, int]:
    """``(group, leaf)`` of an offload key: the leaf directory its file lives in, ``leaf`` being
    the hash's first 20 bits (``top << 8 | second-level shard``)."""
    return int.from_bytes(key[-4:], "big"), int.from_bytes(key[:3], "big") >> 4


def leaf_relpath(group: int, leaf: int) -> str:
    """``<hhh>/<hh>_g<group>``: the leaf directory of :func:`leaf_of`'s ``(group, leaf)``."""
    return f"{leaf >> 8:03x}/{leaf & 0xff:02x}_g{group}"


def chunk_name(key: bytes) -> str:
    """The chunk file name of offload key ``key`` inside its leaf directory."""
    return f"{key[:-4].hex()}.bin"


# --- config.json ------------------------------------------------------------------------------


class ConfigJsonTooLarge(ValueError):
    """``config.json`` holds more than :data:`MAX_CONFIG_JSON_BYTES`."""

    def __init__(self) -> None:
        super().__init__("file too large")


class ConfigJsonNotObject(ValueError):
    """``config.json`` is valid JSON, but not an object."""

    def __init__(self) -> None:
        super().__init__("not a JSON object")


def open_config_json(cfg_fd: int) -> int | None:
    """A descriptor of the ``config.json`` in directory ``cfg_fd`` (read :func:`read_config_bytes`);
    None when there is none. Raises :class:`~kvtier.tiers.fs.beneath.UnsafeEntry` for a link or
    special file, ``OSError`` when it cannot be opened."""
    try:
        return beneath.open_file(cfg_fd, CONFIG_JSON, os.O_RDONLY)
    except FileNotFoundError:
        return None


def read_config_bytes(fd: int) -> bytes:
    """At most :data:`MAX_CONFIG_JSON_BYTES` + 1 bytes of the ``config.json`` open at ``fd``
    (which this closes): enough for :func:`decode_config_json` to tell one too large."""
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_CONFIG_JSON_BYTES + 1)


def decode_config_json(raw: bytes) -> dict[str, Any]:
    """The run fields of a raw ``config.json``. Raises :class:`ConfigJsonTooLarge`,
    :class:`ConfigJsonNotObject`, or the ``ValueError`` of ``json.loads`` (not JSON, not UTF-8)."""
    if len(raw) > MAX_CONFIG_JSON_BYTES:
        raise ConfigJsonTooLarge()
    fields = json.loads(raw)
    if not isinstance(fields, dict):
        raise ConfigJsonNotObject()
    return fields


def ensure_config_json(root_fd: int, ns: Namespace, *, tmp_grace_s: float | None = None,
                       modes: Modes = PRIVATE) -> tuple[bool, int]:
    """Create ``config.json`` in ``ns``'s config directory beneath ``root_fd`` if absent
    (atomically), else verify that it describes this run. Returns ``(created, stale_removed)``.

    An existing file is read first, so a restart on a full disk succeeds when the file matches.
    Creation writes a unique temporary file and hard-links it to the final name, so concurrent
    first starts never see a partial file and never overwrite each other; the temporary file is
    removed whatever happens, and ones left by crashed starts (``config.json_<n>.tmp``) older
    than ``tmp_grace_s`` are swept (``None`` keeps them). An existing file whose fields differ
    from ``ns.fields`` (or that is not valid JSON, is too large, or is a link or special file)
    raises :class:`ConfigError`: its chunks were written by a different geometry and must not be
    read as this run's. The config directory is reached without following links; it and the file
    are created with ``modes`` (an existing one is left as it is).
    """
    cfg_fd = beneath.open_dir(root_fd, ns.leaf, create=True, modes=modes)
    try:
        stale = _sweep_config_tmp(cfg_fd, tmp_grace_s)
        existing = _existing_fields(cfg_fd, ns)
        if existing is None:
            tmp = f"{CONFIG_JSON}_{secrets.randbits(63)}.tmp"
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, modes.file,
                             dir_fd=cfg_fd)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    modes.settle_file(fd)
                    f.write(config_text(ns))
                try:
                    os.link(tmp, CONFIG_JSON, src_dir_fd=cfg_fd, dst_dir_fd=cfg_fd)
                    return True, stale
                except FileExistsError:
                    pass
            finally:
                try:
                    os.unlink(tmp, dir_fd=cfg_fd)
                except FileNotFoundError:
                    pass
            existing = _existing_fields(cfg_fd, ns)
    finally:
        os.close(cfg_fd)
    if existing != ns.fields:
        existing = existing or {}  # None: deleted by someone else between our link and our read
        differing = sorted(k for k in set(existing) | set(ns.fields) if existing.get(k) != ns.fields.get(k))
        raise ConfigError(
            f"{config_path(ns)} describes a different run than this engine (fields differ: {', '.join(differing)}); "
            "refusing to share its chunks"
        )
    return False, stale


def _existing_fields(cfg_fd: int, ns: Namespace) -> dict[str, Any] | None:
    """The parsed ``config.json`` in ``cfg_fd``, or None when there is none; ConfigError when unusable."""
    try:
        fd = open_config_json(cfg_fd)
    except beneath.UnsafeEntry:
        raise ConfigError(f"{config_path(ns)} is a symbolic link or special file; kvtier never follows links "
                          "below root_dir — remove it or use another root_dir") from None
    if fd is None:
        return None
    raw = read_config_bytes(fd)
    try:
        return decode_config_json(raw)
    except ValueError as exc:
        raise ConfigError(f"{config_path(ns)} is not a valid kvtier/vLLM run config ({exc}); remove it or use "
                          "another root_dir") from None


def _sweep_config_tmp(cfg_fd: int, tmp_grace_s: float | None) -> int:
    """Remove ``config.json_<n>.tmp`` files older than ``tmp_grace_s`` (crashed first starts)."""
    if tmp_grace_s is None:
        return 0
    removed = 0
    now = time.time()
    with os.scandir(cfg_fd) as entries:
        candidates = [e for e in entries if CONFIG_TMP.fullmatch(e.name)]
    for entry in candidates:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) or now - st.st_mtime <= tmp_grace_s:
                continue
            os.unlink(entry.name, dir_fd=cfg_fd)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
