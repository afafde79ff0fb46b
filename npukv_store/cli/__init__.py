"""The operator's command line ``npukv``: look at, check and maintain a cache dir.

Runs in: an operator's shell, beside live servers. Every command is safe while
servers use the directory: reads take MVCC snapshots, ``verify --fix`` only
removes crash leftovers no live process can still publish (and quarantines
corrupt chunks when :mod:`npukv_store.maintenance` can), ``rebuild-index`` holds
the directory lock that opening processes take. Reference: docs/cli.md.

    stats DIR            capacity, used/live/dead bytes, fragmentation, namespaces,
                         tenants and pins
    pin DIR ...          never evict the blocks of a prompt (--ttl: until when)
    unpin DIR ...        undo pins (by id, --label or --expired)
    inspect DIR WHAT     a namespace (hex or unique prefix) or a chunk file
    verify DIR           every invariant and checksum (--fast: no data, --fix)
    rebuild-index DIR    a fresh index from the chunk files
    compact DIR ...      the maintenance job: leftovers, then compaction
    gc DIR ...           the maintenance job's garbage step alone
    plan CONFIG_JSON     what a model at a TP and capacity takes: blocks,
                         chunks, index, ring and host memory, prompts reached
    calibrate DIR        measure the disk's cold reads; pick the first-read route
    bench [NAME ...]     python -m bench NAME ... of a source checkout

Human text by default; ``--json`` (stats, inspect) prints one JSON object.
Run as root, every command that opens a cache refuses one root does not own;
``--as-owner`` makes the command that user (uid and gid) before it touches
anything. No command follows a symlink inside the cache.

Exit codes (every command; bench passes its benchmark's through):
    0  ok
    1  problems found (verify, also when --fix fixed them); for compact:
       problems found and fixed
    2  unusable arguments or directory: one line on stderr, no traceback
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from npukv_store import maintenance
from npukv_store.cli import bench, compact, pins, plan, render, reports
from npukv_store.config import StoreConfig, parse_size
from npukv_store.errors import NpuKVError
from npukv_store.store import calibration, recovery
from npukv_store.store.check import check_store
from npukv_store.store.directory import MARKER, CacheDir
from npukv_store.store.format_checks import parse_header
from npukv_store.store.index import Index
from npukv_store.store.permissions import act_as_owner
from npukv_store.store.read.plan import ReadTuning, whole_chunk_plan
from npukv_store.store.read.routes import ChunkFiles
from npukv_store.store.sizing import recorded_map_size

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_UNUSABLE = 2
EPILOG = """exit codes:
  0  ok
  1  problems found (verify, also when --fix fixed them; compact: found and fixed)
  2  unusable arguments or directory: one line on stderr"""
_CHUNK_NAME = re.compile(r"^([0-9a-f]{16})\.safetensors$")


class UsageError(NpuKVError):
    """Arguments the command cannot work with (exit 2)."""


def cache_dir(path: str) -> CacheDir:
    """``path`` as a cache directory, or a UsageError saying why it is not one
    (a ConfigError for an unsafe one: a symlink, another user's, see
    :func:`npukv_store.maintenance.open_cache`)."""
    root = os.path.abspath(path)
    if not os.path.lexists(root):
        raise UsageError(f"{root}: no such directory")
    if os.path.isfile(root) and not os.path.islink(root):
        raise UsageError(f"{root}: is a file, expected a cache directory")
    if os.path.isdir(root) and not os.path.lexists(os.path.join(root, MARKER)):
        raise UsageError(f"{root}: no {MARKER} marker; expected an npukv cache")
    return maintenance.open_cache(root)


def open_dir(path: str) -> tuple[CacheDir, Index, StoreConfig]:
    """The directory, its index (recovered as an open does) and a default config."""
    cdir = cache_dir(path)
    config = StoreConfig(cache_dir=cdir.root)
    # the servers' map size, not the default: a rebuild keeps their headroom
    map_size = recorded_map_size(cdir, config.index_map_size)
    # takes .lock itself (shared; exclusive only to swap a rebuilt index in)
    index = recovery.open_index(cdir, map_size=map_size, sync=True)
    return cdir, index, config


def cmd_stats(args: argparse.Namespace) -> int:
    """Usage of a cache directory: capacity, used, live and dead bytes,
    fragmentation, oldest and newest entry, and one row per namespace."""
    capacity = (
        None if args.capacity is None else parse_size(args.capacity, key="--capacity")
    )
    cdir, index, _ = open_dir(args.cache_dir)
    try:
        if capacity is None:
            capacity = index.recorded_capacity()
        report = reports.stats_report(cdir, index, capacity)
    finally:
        index.close()
    _print(report, args.json, render.stats_sections)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """One namespace (its hex, or a unique prefix: spec, layout, usage) or one
    chunk file (header, tensors, checksum table, live rows per the index)."""
    if args.what is None:  # the old form ``npukv inspect CHUNK_FILE``
        if not os.path.isfile(args.cache_dir):
            raise UsageError(f"{args.cache_dir}: expected DIR NAMESPACE|CHUNK_FILE")
        parents = Path(args.cache_dir).resolve().parents  # <dir>/<ns>/chunks/x
        guess = parents[min(2, len(parents) - 1)]
        root = str(guess) if (guess / MARKER).is_file() else None
        report = inspect_chunk(args.cache_dir, root, args.keys, args.plan)
    elif os.path.isfile(args.what):
        report = inspect_chunk(args.what, args.cache_dir, args.keys, args.plan)
    else:
        cdir, index, _ = open_dir(args.cache_dir)
        try:
            namespace = find_namespace(cdir, index, args.what)
            report = reports.namespace_report(cdir, index, namespace)
        finally:
            index.close()
        _print(report, args.json, render.namespace_sections)
        return EXIT_OK
    _print(report, args.json, render.chunk_sections)
    return EXIT_OK


def inspect_chunk(
    path: str, root: str | None, keys: int, plan: bool = False
) -> dict[str, Any]:
    """The chunk report of ``path``, with live rows when ``root``'s index has
    it, and with ``plan`` how a server's first read of all of it would go now
    (default tuning, O_DIRECT on, verified)."""
    fd = os.open(path, os.O_RDONLY)
    files = ChunkFiles(path, fd, direct=True)
    try:
        header = parse_header(fd, path)
        read_plan = (
            whole_chunk_plan(
                header, files.residency, ReadTuning(), first_read=True, verify=True
            )
            if plan
            else None
        )
    finally:
        files.close()
    match = _CHUNK_NAME.match(os.path.basename(path))
    live = None
    if match and root is not None:
        _, index, _ = open_dir(root)
        try:
            record = index.chunk(int(match.group(1), 16))
        finally:
            index.close()
        live = None if record is None else record.live_rows
    report = reports.chunk_report(header, match and match.group(1), live, keys)
    if read_plan is not None:
        report["read_plan"] = read_plan.explain().splitlines()
    return report


def find_namespace(cdir: CacheDir, index: Index, prefix: str) -> str:
    """The one namespace (on disk or in the index) whose hex starts with ``prefix``."""
    known = set(cdir.namespaces()) | {r.namespace.hex() for r in index.iter_chunks()}
    found = sorted(ns for ns in known if ns.startswith(prefix.lower()))
    if not re.fullmatch(r"[0-9a-fA-F]{1,32}", prefix) or not found:
        raise UsageError(
            f"{prefix}: no such chunk file, and no namespace of {cdir.root} starts "
            f"with it (namespaces: {', '.join(sorted(known)) or 'none'})"
        )
    if len(found) > 1:
        raise UsageError(f"{prefix}: matches {len(found)} namespaces: {found}")
    return found[0]


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every invariant of the index and chunk files and every live row's
    checksums (--fast: not the data); one line per problem, exit 1 if any.
    --fix removes crash leftovers and quarantines bad chunks."""
    cdir, index, config = open_dir(args.cache_dir)
    try:
        recorded = index.recorded_capacity()
        if recorded is not None:  # judge the ledger by the servers' budget
            config = dataclasses.replace(config, capacity=recorded)
        problems = check_store(
            cdir, index, config, verify_data=not args.fast, fix=False
        )
    finally:
        index.close()
    fixed = fix(cdir, args.fast) if args.fix else []
    for line in [*problems, *fixed]:  # they quote file names and metadata
        print(render.printable(line))
    print(f"{len(problems)} problem(s) in {render.printable(cdir.root)}")
    return EXIT_PROBLEMS if problems else EXIT_OK


def fix(cdir: CacheDir, fast: bool) -> list[str]:
    """The maintenance job's repairs alone: crash leftovers removed and, unless
    ``fast``, every block read and bad chunks quarantined; one line each."""
    options = maintenance.Options(cache_dir=cdir.root, verify=not fast, compact=False)
    summary = maintenance.run(options)
    done = [f"fixed: quarantined {line}" for line in summary.quarantined_chunks]
    leftovers = summary.problems - summary.quarantined
    done.append(f"fixed: removed {leftovers} crash leftover(s)")
    return done


def cmd_rebuild_index(args: argparse.Namespace) -> int:
    """Rebuild the index from the chunk files' own metadata (decision 0059)."""
    cdir = cache_dir(args.cache_dir)
    config = StoreConfig(cache_dir=cdir.root)
    map_size = recorded_map_size(cdir, config.index_map_size)
    # takes .lock itself for the swap; opens serve while its batches commit
    index = recovery.rebuild_index(cdir, map_size=map_size, sync=True)
    total, chunks, blocks = index.totals()
    index.close()
    print(
        f"rebuilt {render.printable(cdir.index_path)}: {chunks} chunks, {blocks} "
        f"blocks, {total} bytes"
    )
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    """Pin a prompt: the blocks of every request that begins with it are never
    evicted or compacted away while the pin lasts (--ttl), in every model and
    TP rank sharing the directory; they count against capacity. Servers apply
    it to the first request that begins with it, within a second."""
    return pins.cmd_pin(args, open_dir)


def cmd_unpin(args: argparse.Namespace) -> int:
    """Remove pins (by id, --label or --expired): their blocks go back to the
    LRU at their last use."""
    return pins.cmd_unpin(args, open_dir)


def run_maintenance(command: str, argv: list[str]) -> int:
    if "--as-owner" in argv:  # before the check below, which root would fail
        act_as_owner(argv[0])
    cache_dir(argv[0])
    return compact.main(argv, prog=f"npukv {command}")


def cmd_compact(args: argparse.Namespace) -> int:
    """Run the maintenance job (npukv_store.maintenance): remove crash
    leftovers, optionally verify (--verify) and evict (--target), then rewrite
    chunks heavy in dead rows. Its options follow DIR."""
    return run_maintenance("compact", [args.cache_dir, *args.rest])


def cmd_gc(args: argparse.Namespace) -> int:
    """Run the maintenance job's garbage step alone (--gc-only): tmp files of
    dead writers, orphan chunk files, index rows whose file is gone, stale
    staging rings and save claims. Its options follow DIR."""
    return run_maintenance("gc", [args.cache_dir, "--gc-only", *args.rest])


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure the cold reads of the cache directory's disk (buffered and
    O_DIRECT, queue depth 1 and 16, on a scratch file in tmp/) and keep the
    result in calibration.json, from which readers pick their first-read route."""
    cdir = cache_dir(args.cache_dir)
    found = calibration.measure(cdir, args.sample_mib << 20)
    calibration.save(cdir, found)
    report = {"cache_dir": cdir.root, "read_calibration": found.summary()}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"npukv calibrate {render.printable(cdir.root)}: first reads "
              + render.calibration_text(found.summary()))  # fmt: skip
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark of a source checkout (python -m bench NAME, with this
    interpreter; without NAME it lists them); the arguments after NAME go to
    the benchmark. An installed wheel has none: one line says what to run."""
    return bench.run([args.name, *args.rest] if args.name else [])


def _print(report: dict[str, Any], as_json: bool, sections: Any) -> None:
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        render.emit(sections(report))


def build_parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").split("\n\n")
    parser = argparse.ArgumentParser(
        prog="npukv", description="\n\n".join([doc[0], doc[2], doc[3]]), epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, func: Any, *, directory: bool = True
    ) -> argparse.ArgumentParser:
        summary = " ".join((func.__doc__ or "").split())
        cmd = sub.add_parser(
            name, help=summary, description=textwrap.fill(summary, 79), epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        if directory:
            cmd.add_argument("cache_dir", metavar="DIR", help="the cache directory")
            compact.add_as_owner(cmd)
        cmd.set_defaults(func=func)
        return cmd

    stats = command("stats", cmd_stats)
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.add_argument(
        "--capacity",
        metavar="SIZE",
        help="report against this (e.g. 500GiB); default: the capacity of the "
        "latest committing server",
    )
    inspect_cmd = command("inspect", cmd_inspect)
    inspect_cmd.add_argument(
        "what",
        nargs="?",
        metavar="NAMESPACE|CHUNK_FILE",
        help="a namespace's hex (or a unique prefix) or a chunk file",
    )
    inspect_cmd.add_argument("--json", action="store_true", help="one JSON object")
    inspect_cmd.add_argument(
        "--keys", type=int, default=4, metavar="N", help="chunk keys to list"
    )
    inspect_cmd.add_argument(
        "--plan",
        action="store_true",
        help="chunk file: how a first read of all of it would go now (each "
        "layer's route and why, from the page cache's residency)",
    )
    verify = command("verify", cmd_verify)
    verify.add_argument(
        "--fast", action="store_true", help="headers and index only: no data checksums"
    )
    verify.add_argument(
        "--fix",
        action="store_true",
        help="remove crash leftovers; quarantine bad chunks",
    )
    command("rebuild-index", cmd_rebuild_index)
    pins.add_arguments(command("pin", cmd_pin), command("unpin", cmd_unpin))
    for name, func in (("compact", cmd_compact), ("gc", cmd_gc)):
        command(name, func).add_argument(
            "rest", nargs=argparse.REMAINDER, metavar="...",
            help="options of npukv_store.maintenance, after DIR",
        )  # fmt: skip
    plan.add_arguments(command("plan", plan.cmd_plan, directory=False))
    calibrate = command("calibrate", cmd_calibrate)
    calibrate.add_argument("--json", action="store_true", help="one JSON object")
    calibrate.add_argument(
        "--sample-mib", type=int, default=64, metavar="N",
        help="size of the scratch file read (default 64)",
    )  # fmt: skip
    bench_cmd = command("bench", cmd_bench, directory=False)
    bench_cmd.add_argument(
        "name", nargs="?", metavar="NAME",
        help="a benchmark (store, io, vllm, serve, ...): python -m bench NAME",
    )  # fmt: skip
    bench_cmd.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar="...",
        help="the benchmark's arguments",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``npukv``; unusable input is one line on stderr, exit 2."""
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "as_owner", False):  # before anything is touched
            act_as_owner(args.cache_dir)
        return int(args.func(args))
    except BrokenPipeError:  # the reader (head, a pager) left early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (NpuKVError, OSError) as exc:
        print(f"npukv {args.command}: {render.printable(exc)}", file=sys.stderr)
        return EXIT_UNUSABLE


if __name__ == "__main__":
    sys.exit(main())
