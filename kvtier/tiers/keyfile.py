"""Encryption key files: the keys a tier encrypts stored chunks with, loaded once at tier open.

Format (text, UTF-8): one key per line, ``<key_id>:<64 hex digits>``: a decimal key id from 1 to
4294967295 and an AES-256 key (32 bytes in hex). Blank lines and lines starting with ``#`` are
ignored; spaces around the fields are allowed. Ids are unique within a file. Example::

    # kvtier chunk keys; the tier option encryption.key_id picks the one new chunks use
    1:6b1f0c...(64 hex digits)
    2:09aa41...(64 hex digits)

Every key in the file decrypts; the configured ``key_id`` encrypts. Rotation: add the new key
with a new id, switch ``key_id`` to it, and keep the old line until the chunks encrypted with it
are gone (a chunk whose key id is no longer in the file is a miss, then rewritten with the current
key).

The file must be a regular file (a symbolic link is refused) owned by the process's user (or
root) that neither group nor others may read or write (mode ``0600`` or ``0400``); anything else
is a :class:`~kvtier.errors.ConfigError` at tier open. Key bytes never appear in ``repr``,
``str``, errors or logs: messages name the file and the line number, never a line's text.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["Keyring", "load_key_file", "parse_keys", "MAX_KEY_ID", "KEY_BYTES"]

KEY_BYTES = 32
MAX_KEY_ID = 0xFFFFFFFF
#: A key file is a handful of lines; anything far larger is not one (and is not read into memory).
_MAX_FILE_BYTES = 1 << 20
_HEX = frozenset("0123456789abcdefABCDEF")


class Keyring:
    """The keys of one key file, by id; ``repr`` and ``str`` show the ids only."""

    __slots__ = ("_keys", "source")

    def __init__(self, keys: Mapping[int, bytes], source: str = "") -> None:
        self._keys = dict(keys)
        self.source = source

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._keys))

    def key(self, key_id: int) -> bytes | None:
        """The key with id ``key_id``, or None."""
        return self._keys.get(key_id)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def __repr__(self) -> str:
        return f"Keyring(ids={list(self.ids)}, source={self.source!r})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:  # never pickled into a worker or a log by accident
        raise TypeError("a Keyring cannot be pickled")


def parse_keys(text: str, source: str = "key file") -> Keyring:
    """The keys in ``text`` (the key-file format of the module docstring); ``ConfigError`` naming
    ``source`` and the line number for a malformed line or a repeated id (never the line itself)."""
    keys: dict[int, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key_id_text, sep, hex_text = line.partition(":")
        key_id_text, hex_text = key_id_text.strip(), hex_text.strip()
        if (not sep or not key_id_text.isascii() or not key_id_text.isdigit()
                or len(hex_text) != 2 * KEY_BYTES or not set(hex_text) <= _HEX):
            raise ConfigError(f"{source}, line {number}: expected '<key_id>:<{2 * KEY_BYTES} hex digits>' "
                              "(an AES-256 key); the line is not shown")
        key_id = int(key_id_text)
        if not 1 <= key_id <= MAX_KEY_ID:
            raise ConfigError(f"{source}, line {number}: key id must be 1..{MAX_KEY_ID}, got {key_id}")
        if key_id in keys:
            raise ConfigError(f"{source}, line {number}: key id {key_id} appears twice")
        keys[key_id] = bytes.fromhex(hex_text)
    if not keys:
        raise ConfigError(f"{source}: no keys (expected lines '<key_id>:<{2 * KEY_BYTES} hex digits>')")
    return Keyring(keys, source)


def load_key_file(path: str | os.PathLike[str], *, where: str = "encryption.key_file") -> Keyring:
    """Read and check the key file at ``path`` (see the module docstring); ``ConfigError`` when it
    is missing, a link, not a regular file, open to group or others, too large or malformed."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{where}: {name!r} is a symbolic link; point it at the key file itself") from None
        raise ConfigError(f"{where}: cannot open {name!r}: {os.strerror(exc.errno or 0)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: {name!r} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            # Whoever owns it can read or replace the keys: decrypt the cache, forge chunks.
            raise ConfigError(f"{where}: {name!r} is owned by uid {st.st_uid}, not by this process's user "
                              f"(uid {os.geteuid()}) or root; chown it")
        if st.st_mode & 0o077:
            raise ConfigError(f"{where}: {name!r} is accessible by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); make it owner-only: chmod 600")
        if st.st_size > _MAX_FILE_BYTES:
            raise ConfigError(f"{where}: {name!r} is {st.st_size} bytes, too large for a key file")
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {name!r} is not UTF-8 text") from None
    return parse_keys(text, f"{where} {name!r}")
