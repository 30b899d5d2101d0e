"""``kvtier inspect ROOT [--json]``: what an fs-tier root holds, from ``stat`` alone.

Lists every run namespace under ROOT (``<model>_<digest>`` with a valid ``config.json``, see
:mod:`kvtier.ops.runs`), its run fields, its compatibility manifest (model, ``model_revision``,
``namespace_tag``: :mod:`kvtier.layout`; neither set is vLLM's exact namespace) and the ranks
whose trees exist, and per rank tree: chunk
files, their bytes, oldest/newest mtime, files of the trailer-less size (exactly ``slot_bytes``:
vLLM's format), temporary files (``*.tmp`` of writes in progress or crashed, O_DIRECT probe
files), stray entries (names not of the layout) and unsafe entries (links or special files where
a chunk or shard directory belongs); then totals. No file is opened except ``config.json`` (and,
in a tree whose files have more than the two plain sizes, a compressed or encrypted tier's, the
trailers of up to three files of each of its three most common sizes, to learn the slot size); the
shard directories of a big tree are listed by ``--scan-workers`` processes at the lowest CPU
priority (:func:`kvtier.ops.runs.list_tree`); nothing is changed.

``slot_bytes``: ``config.json`` holds the run fields, not the KV geometry (head count and size),
so the slot size is derived from the tree's file sizes (:func:`kvtier.ops.runs.guess_slot_bytes`:
the most common size is the trailered size ``slot_bytes + 4096``, unless files 4096 bytes larger
exist too, then it is a trailer-less vLLM tree), or from a few trailers when the sizes vary (coded
files: :mod:`kvtier.tiers.codec`); ``--slot-bytes`` overrides both. ``kvtier verify`` confirms it
from the trailers.

Exit status: 0 when nothing is wrong by stat alone; 1 when ROOT holds unsafe entries, stray
entries, invalid run directories or orphan trees, or the output could not be written; 2 on
usage errors (including a ROOT that does not exist or is not a directory). Names are printed
escaped (:func:`kvtier.ops.runs.printable`), in the text and the JSON alike.

``--json`` prints one document::

    {
      "root": str,
      "runs": [{
        "name": "<model>_<digest>", "model": str, "digest": str, "fields": {run fields},
        "manifest": {"model": str, "model_revision": str | null, "namespace_tag": str | null,
                     "vllm_compatible": bool},            # true: neither revision nor tag is set
        "ranks": [int],
        "trees": [{
          "name": "<model>_<digest>_r<rank>", "rank": int,
          "slot_bytes": int | null, "slot_bytes_source": "option" | "guessed" | "trailer" | null,
          "chunk_files": int, "chunk_bytes": int,
          "oldest_mtime": float | null, "newest_mtime": float | null,   # Unix seconds
          "trailerless_files": int, "coded_files": int,                  # compressed/encrypted
          "other_size_files": int,                                       # none of those sizes
          "tmp_files": int, "tmp_bytes": int,
          "stray_entries": [relpath], "unsafe_entries": [relpath]        # relative to the tree
        }]
      }],
      "invalid_runs": [{"name": str, "reason": str}],
      "orphan_trees": [str], "unsafe_entries": [str], "other_entries": [str],   # directly under ROOT
      "totals": {"runs", "trees", "chunk_files", "chunk_bytes", "trailerless_files", "coded_files",
                 "other_size_files", "tmp_files", "tmp_bytes", "stray_entries", "unsafe_entries"}: int
    }
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvtier.ops import runs as _runs
from kvtier.ops.cli_args import CliParser
from kvtier.ops.runs import Progress, discover, format_bytes, guess_slot_bytes, list_tree, run_on_root
from kvtier.tiers.codec import is_coded_file_size
from kvtier.tiers.fs import beneath
from kvtier.tiers.integrity import TRAILER_PAGE

__all__ = ["run_inspect_cli", "build_parser", "inspect_root"]

_EPILOG = """\
exit status:
  0  nothing wrong by stat alone
  1  unsafe entries (links, special files), stray entries, invalid run directories or orphan trees;
     or the output could not be written
  2  usage error (bad arguments, ROOT missing or not a directory)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="kvtier inspect",
        description="Summarise the fs-tier runs under ROOT from stat alone (no chunk reads but a few trailers "
                    "where the sizes vary; no changes).",
        epilog=_EPILOG,
        formatter_class=_runs.HelpFormatter,
    )
    parser.add_argument("root", metavar="ROOT", help="the fs tier's root_dir")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema: module docstring)")
    parser.add_argument("--scan-workers", type=_runs.count_arg, default=_runs.SCAN_WORKERS, metavar="N",
                        help="worker processes listing the shard directories of a big tree (the usable cores); "
                             "raise it on network filesystems (NFS), where every stat waits on the server")
    parser.add_argument("--slot-bytes", type=_positive_int, default=None, metavar="BYTES",
                        help="slot size of every run (e.g. 256KiB); derived from the most common file size when not given")
    return parser


_positive_int = _runs.size_arg


def _recorded_slot(root_fd: int, name: str, listing: _runs.TreeListing) -> int | None:
    """The slot size a few of the tree's trailers record; None where they say none, or the tree
    cannot be opened any more (removed, or replaced by a link, since it was listed)."""
    try:
        tree_fd = beneath.open_dir(root_fd, name)
    except OSError:
        return None
    try:
        return _runs.slot_from_trailers(tree_fd, listing)
    finally:
        os.close(tree_fd)


def _tree_report(listing: _runs.TreeListing, slot_option: int | None,
                 recorded_slot: Callable[[], int | None]) -> dict[str, Any]:
    sizes = [c.size for c in listing.chunks]
    slot, source = slot_option, "option"
    if slot is None:
        slot, source = guess_slot_bytes(sizes), "guessed"
        if slot is None or any(s not in (slot, slot + TRAILER_PAGE) for s in sizes):
            # Sizes beyond the plain two (a compressed or encrypted tier's files): the trailers say.
            recorded = recorded_slot()
            if recorded is not None:
                slot, source = recorded, "trailer"
    raw = sum(1 for s in sizes if s == slot) if slot is not None else 0
    trailered = sum(1 for s in sizes if s == slot + TRAILER_PAGE) if slot is not None else 0
    coded = sum(1 for s in sizes if is_coded_file_size(s, slot)) if slot is not None else 0
    return {
        "slot_bytes": slot,
        "slot_bytes_source": None if slot is None else source,
        "chunk_files": len(sizes),
        "chunk_bytes": sum(sizes),
        "oldest_mtime": listing.chunks[0].mtime if listing.chunks else None,
        "newest_mtime": max(c.mtime for c in listing.chunks) if listing.chunks else None,
        "trailerless_files": raw,
        "coded_files": coded,
        "other_size_files": len(sizes) - raw - trailered - coded,
        "tmp_files": len(listing.tmp),
        "tmp_bytes": sum(t.size for t in listing.tmp),
        "stray_entries": sorted(e.relpath for e in listing.stray),
        "unsafe_entries": sorted(e.relpath for e in listing.unsafe),
    }


def inspect_root(root_fd: int, root: str, *, slot_bytes: int | None = None,
                 progress_stream: TextIO | None = None, scan_workers: int = _runs.SCAN_WORKERS) -> dict[str, Any]:
    """The report of ``kvtier inspect`` (the ``--json`` document) for ROOT open as ``root_fd``."""
    found = discover(root_fd)
    done = [0]
    lock = threading.Lock()
    started = time.monotonic()

    def tick() -> None:
        with lock:
            done[0] += 1

    def render() -> str:
        return f"kvtier inspect: {done[0]} shard directories listed ({time.monotonic() - started:.1f} s)"

    report_runs = []
    totals = dict.fromkeys(("runs", "trees", "chunk_files", "chunk_bytes", "trailerless_files", "coded_files",
                            "other_size_files", "tmp_files", "tmp_bytes", "stray_entries", "unsafe_entries"), 0)
    with Progress(render, stream=progress_stream):
        for run in found.runs:
            trees = []
            for tree in run.trees:
                listing = list_tree(root_fd, tree.name, workers=scan_workers, on_shard=tick)
                recorded = functools.partial(_recorded_slot, root_fd, tree.name, listing)
                entry = {"name": tree.name, "rank": tree.rank, **_tree_report(listing, slot_bytes, recorded)}
                trees.append(entry)
                totals["trees"] += 1
                for key in ("chunk_files", "chunk_bytes", "trailerless_files", "coded_files", "other_size_files",
                            "tmp_files", "tmp_bytes"):
                    totals[key] += entry[key]
                totals["stray_entries"] += len(entry["stray_entries"])
                totals["unsafe_entries"] += len(entry["unsafe_entries"])
            totals["runs"] += 1
            report_runs.append({
                "name": run.name, "model": run.model, "digest": run.digest, "fields": run.fields,
                "manifest": _manifest(run), "ranks": [t.rank for t in run.trees], "trees": trees,
            })
    totals["unsafe_entries"] += len(found.unsafe_entries)
    return {
        "root": root,
        "runs": report_runs,
        "invalid_runs": [{"name": n, "reason": r} for n, r in found.invalid_runs],
        "orphan_trees": found.orphan_trees,
        "unsafe_entries": found.unsafe_entries,
        "other_entries": found.other_entries,
        "totals": totals,
    }


def _manifest(run: _runs.Run) -> dict[str, Any]:
    manifest = run.manifest
    manifest["vllm_compatible"] = manifest["model_revision"] is None and manifest["namespace_tag"] is None
    return manifest


def _manifest_line(manifest: dict[str, Any]) -> str:
    if manifest["vllm_compatible"]:
        return "  manifest none (vLLM-compatible namespace)"
    parts = [f"model {manifest['model']}"]
    for key in ("model_revision", "namespace_tag"):
        parts.append(f"{key} {manifest[key] if manifest[key] is not None else '-'}")
    return "  manifest " + "  ".join(parts)


def _has_problems(report: dict[str, Any]) -> bool:
    t = report["totals"]
    return bool(t["stray_entries"] or t["unsafe_entries"] or report["invalid_runs"] or report["orphan_trees"])


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _print_text(report: dict[str, Any], out: TextIO) -> None:
    """``report`` (already :func:`~kvtier.ops.runs.printable_report`) as text."""
    t = report["totals"]
    print(f"root {report['root']}: {t['runs']} run(s), {t['trees']} rank tree(s)", file=out)
    for run in report["runs"]:
        f = run["fields"]
        print(f"\nrun {run['name']}", file=out)
        print(f"  model {run['model']}  digest {run['digest']}  ranks {run['ranks'] or '-'}", file=out)
        print(_manifest_line(run["manifest"]), file=out)
        interesting = ("tokens_per_hash", "blocks_per_file", "dtype", "tp_size", "pp_size", "pcp_size", "dcp_size",
                       "parallel_agnostic", "inference_engine")
        print("  fields " + "  ".join(f"{k}={f[k]}" for k in interesting if k in f), file=out)
        for tree in run["trees"]:
            slot = tree["slot_bytes"]
            print(f"  tree {tree['name']} (rank {tree['rank']})", file=out)
            print(f"    chunk files  {tree['chunk_files']}  ({format_bytes(tree['chunk_bytes'])}, "
                  f"{tree['chunk_bytes']} bytes)", file=out)
            print(f"    slot bytes   {slot if slot is not None else '-'}"
                  f"{' (' + tree['slot_bytes_source'] + ')' if slot is not None else ''}", file=out)
            print(f"    mtimes       oldest {_when(tree['oldest_mtime'])}  newest {_when(tree['newest_mtime'])}",
                  file=out)
            print(f"    trailer-less {tree['trailerless_files']}  coded {tree['coded_files']}  "
                  f"other sizes {tree['other_size_files']}  "
                  f"tmp {tree['tmp_files']} ({format_bytes(tree['tmp_bytes'])})  "
                  f"stray {len(tree['stray_entries'])}  unsafe {len(tree['unsafe_entries'])}", file=out)
            for label in ("stray_entries", "unsafe_entries"):
                for rel in tree[label][:10]:
                    print(f"      {label.split('_')[0]}: {rel}", file=out)
                if len(tree[label]) > 10:
                    print(f"      ... {len(tree[label]) - 10} more", file=out)
    for item in report["invalid_runs"]:
        print(f"\ninvalid run directory {item['name']}: {item['reason']}", file=out)
    for label in ("orphan_trees", "unsafe_entries", "other_entries"):
        if report[label]:
            names = report[label]
            more = f" ... {len(names) - 20} more" if len(names) > 20 else ""
            print(f"\n{label.replace('_', ' ')} under root: {', '.join(names[:20])}{more}", file=out)
    print(f"\ntotal: {t['chunk_files']} chunk files, {format_bytes(t['chunk_bytes'])}; "
          f"trailer-less {t['trailerless_files']}, coded {t['coded_files']}, other sizes {t['other_size_files']}, "
          f"tmp {t['tmp_files']}, "
          f"stray {t['stray_entries']}, unsafe {t['unsafe_entries']}", file=out)


def run_inspect_cli(argv: Sequence[str], *, out: TextIO | None = None) -> int:
    """Entry point of ``kvtier inspect`` (exit status: see the module docstring)."""
    stream = out if out is not None else sys.stdout
    return run_on_root("inspect", build_parser(), argv, lambda args, root_fd: _inspect(args, root_fd, stream))


def _inspect(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    report = inspect_root(root_fd, args.root, slot_bytes=args.slot_bytes, scan_workers=args.scan_workers)
    if args.json:
        _runs.write_json(report, out)
    else:
        _print_text(_runs.printable_report(report, out), out)
    return 1 if _has_problems(report) else 0
