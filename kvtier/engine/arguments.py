"""Checks of the engine's call arguments: at the call, before any work is queued.

Semantics callers rely on:

* Token ids and block ids are sequences of ints: a ``list`` or ``tuple`` (or any other
  sequence), or a one-dimensional numpy array / torch tensor of an integer dtype. numpy integer
  scalars (and other ``int`` subclasses) inside a sequence are accepted and used as the plain
  ints they equal, so one prompt gives the same chunk keys however its ids are typed.
  ``bool``, ``float``, ``str``, ``None`` and anything else non-integral is a ``TypeError``; an
  id below 0 (or above ``2**64 - 1``) is a ``ValueError``. Every message names the argument,
  the position and the value.
* The block ids a call will use must lie in ``[0, num_blocks)`` of the device KV cache and be
  distinct (``ValueError``); ``block_ids`` beyond what the call uses are only type-checked.
  Without a device KV cache the range is not known, so only the types, signs and duplicates are
  checked.
* With several KV-cache groups, ``block_ids`` holds one such sequence per group, in group order
  (:func:`group_ids`); a one-group model takes the plain sequence or a one-element list of it.
* Counts (``num_computed_tokens``, ``num_prompt_tokens``) are ints >= 0.

Cost: the serving path pays two C-level passes over a plain list of ints (``set(map(type, ids))``
for the types, ``array("Q", ids)`` for the range) and no per-element Python work; elements are
visited one by one only to build an error message or to convert numpy scalars.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["int_ids", "group_ids", "check_block_ids", "count"]

_PLAIN_INT = frozenset({int})
_MAX_ID = 2**64 - 1


def int_ids(values: Any, name: str) -> Sequence[int]:
    """``values`` as a sequence of plain, non-negative ints; ``values`` itself when it already is one.

    Raises ``TypeError`` for a non-sequence or a non-integral element, ``ValueError`` for an id
    outside ``[0, 2**64)``.
    """
    if isinstance(values, (list, tuple)):
        ids: Sequence[Any] = values
    elif isinstance(values, (str, bytes, bytearray)) or values is None:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    elif hasattr(values, "ndim") and callable(getattr(values, "tolist", None)):
        # numpy arrays and torch tensors: tolist() gives plain ints (or floats/bools, refused below).
        if values.ndim != 1:
            raise TypeError(f"{name} must be one-dimensional, got {values.ndim} dimensions")
        ids = values.tolist()
    elif isinstance(values, Sequence):
        ids = list(values)
    else:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    types = set(map(type, ids))
    if not types <= _PLAIN_INT:
        _refuse_non_integral(ids, types, name)
        ids = list(map(int, ids))  # numpy scalars / int subclasses: hash as the ints they equal
    try:
        array.array("Q", ids)  # one C pass: every id in [0, 2**64)
    except OverflowError:
        index, value = next((i, v) for i, v in enumerate(ids) if not 0 <= v <= _MAX_ID)
        bound = "must be >= 0" if value < 0 else "is larger than 2**64 - 1"
        raise ValueError(f"{name}[{index}] = {value} {bound}") from None
    return ids


def group_ids(values: Any, num_groups: int, name: str = "block_ids") -> list[Sequence[int]]:
    """``values`` as one sequence of ints per KV-cache group (each through :func:`int_ids`).

    A one-group model takes a plain sequence of ints too. ``TypeError`` for anything else,
    ``ValueError`` for a number of sequences other than ``num_groups``.
    """
    if num_groups == 1 and not _nested(values):
        return [int_ids(values, name)]
    if not _nested(values):
        raise TypeError(f"{name} must hold one sequence of block ids per KV-cache group ({num_groups})")
    groups = list(values)
    if len(groups) != num_groups:
        raise ValueError(f"{name} has {len(groups)} sequences; the model has {num_groups} KV-cache groups")
    return [int_ids(ids, f"{name}[{g}]" if num_groups > 1 else name) for g, ids in enumerate(groups)]


def _nested(values: Any) -> bool:
    """Whether ``values`` is a list or tuple whose first element is itself a sequence of ids."""
    if not isinstance(values, (list, tuple)) or not values:
        return False
    first = values[0]
    return not isinstance(first, (str, bytes, bytearray)) and (
        isinstance(first, (list, tuple, range)) or getattr(first, "ndim", 0) == 1)


def _refuse_non_integral(ids: Sequence[Any], types: set[type], name: str) -> None:
    for bad_type in types:
        if not _is_integral(bad_type):
            index, value = next((i, v) for i, v in enumerate(ids) if type(v) is bad_type)
            raise TypeError(
                f"{name}[{index}] is {value!r} ({bad_type.__name__}); {name} must hold ints"
            )


def _is_integral(value_type: type) -> bool:
    if value_type is bool:
        return False
    if issubclass(value_type, int):
        return True
    numpy = sys.modules.get("numpy")  # a numpy scalar can only exist once numpy is imported
    return numpy is not None and issubclass(value_type, numpy.integer)


def check_block_ids(block_ids: Sequence[int], start: int, end: int, num_blocks: int | None,
                    name: str = "block_ids") -> None:
    """Check the block ids a call uses, ``block_ids[start:end]`` (already through :func:`int_ids`).

    ``ValueError`` when ``block_ids`` is shorter than ``end``, an id is not below ``num_blocks``
    (``None``: unknown, not checked) or an id repeats.
    """
    if end <= start:  # the call uses no block (nothing to load or offload)
        return
    if len(block_ids) < end:
        raise ValueError(f"{name} has {len(block_ids)} entries; {end} device blocks are needed")
    used = block_ids[start:end]
    if not used:
        return
    if num_blocks is not None and max(used) >= num_blocks:
        index, value = next((i, b) for i, b in enumerate(used, start) if b >= num_blocks)
        raise ValueError(
            f"{name}[{index}] = {value} is out of range: the device KV cache has blocks [0, {num_blocks})"
        )
    if len(set(used)) != len(used):
        first_seen: dict[int, int] = {}
        for index, value in enumerate(used, start):
            if value in first_seen:
                raise ValueError(
                    f"{name}[{index}] = {value} repeats {name}[{first_seen[value]}]; "
                    "the blocks a call uses must be distinct"
                )
            first_seen[value] = index


def count(value: Any, name: str) -> int:
    """``value`` as a plain int >= 0 (``TypeError`` if not integral, ``ValueError`` if negative)."""
    if type(value) is not int:
        if not _is_integral(type(value)):
            raise TypeError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
        value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
