"""One chunk file's parts for the tests of the fs primitives and of ``kvtier verify``: a page-aligned
slot and the trailer page that proves it is ``ME``."""

from __future__ import annotations

import hashlib
import mmap

from kvtier.keys import make_offload_key
from kvtier.tiers.integrity import identity, make_trailer_page

SLOT = 16384
ME = identity(make_offload_key(hashlib.sha256(b"c").digest(), 0), hashlib.sha256(b"run").digest())


def slot_filled_with(fill: int) -> memoryview:
    buf = mmap.mmap(-1, SLOT)  # page aligned, as host slots are
    buf.write(bytes([fill]) * SLOT)
    return memoryview(buf)


def trailer_page_of(src: memoryview | bytes) -> bytes:
    return make_trailer_page(src, ME)
