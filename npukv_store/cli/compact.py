"""The maintenance job's command line: ``npukv compact|gc`` and
``scripts/compact.py`` (:mod:`npukv_store.maintenance` is the job).

Runs in: the job's own process (cron, a systemd timer, an operator's shell).

    main()         - parse the options, run the job with progress, print the
                     summary (text, or one JSON object); the exit code
    build_parser() - the options

``--as-owner`` (run as root): become the directory's owner (its uid and gid)
before anything in it is touched; without it, root refuses a directory it does
not own.

Exit codes: 0 nothing was wrong; 1 problems were found (and fixed, unless
``--dry-run``); 2 unusable arguments or directory, or another run holds the lock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict

from npukv_store.cli.render import printable
from npukv_store.config import parse_size
from npukv_store.errors import ConfigError, NpuKVError
from npukv_store.maintenance import Options, Summary, run
from npukv_store.store.permissions import act_as_owner

logger = logging.getLogger("npukv.maintenance")


def build_parser(prog: str = "compact.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Maintain an npukv cache directory while servers use it: "
        "remove crash leftovers, optionally verify every block and evict down to "
        "a target, then compact.",
        epilog="exit codes: 0 nothing was wrong; 1 problems were found (and "
        "fixed unless --dry-run); 2 unusable arguments or directory, or another "
        "maintenance run holds the lock",
    )
    parser.add_argument("cache_dir", help="the cache directory (with its marker)")
    parser.add_argument("--dry-run", action="store_true", help="report, change nothing")
    parser.add_argument(
        "--target", type=_fraction, metavar="FRACTION",
        help="evict the oldest chunks down to FRACTION of capacity (0..1)",
    )  # fmt: skip
    parser.add_argument(
        "--min-live", type=_fraction, default=0.5, metavar="FRACTION",
        help="rewrite chunks whose live fraction is below this (default 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--capacity", type=_size, metavar="SIZE",
        help="capacity to evict against (default: the servers', from the index)",
    )  # fmt: skip
    parser.add_argument(
        "--verify", action="store_true",
        help="read every live block, check its checksums, quarantine bad chunks",
    )  # fmt: skip
    parser.add_argument("--gc-only", action="store_true", help="the garbage step alone")
    parser.add_argument(
        "--rebuild-index", action="store_true",
        help="rebuild the index from the chunk files first",
    )  # fmt: skip
    parser.add_argument(
        "--chunk-size", type=_size, metavar="SIZE",
        help="merge small chunks up to this (default 64MiB, the servers' "
        "chunk_target_size)",
    )  # fmt: skip
    parser.add_argument(
        "--grace", type=float, metavar="SECONDS",
        help="spare chunks used this recently from eviction (default 5, the "
        "servers' evict_grace_s)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON summary")
    parser.add_argument(
        "--ring-dir", default="/dev/shm", help="where staging rings live (/dev/shm)"
    )
    add_as_owner(parser)
    return parser


def add_as_owner(parser: argparse.ArgumentParser) -> None:
    """The ``--as-owner`` flag (shared with ``npukv``)."""
    parser.add_argument(
        "--as-owner", action="store_true",
        help="run as root: act as the directory's owner (its uid and gid) "
        "before touching it; without it, root refuses a directory it does not own",
    )  # fmt: skip


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"found {text!r}, expected a fraction 0..1")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text, key="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None, prog: str = "compact.py") -> int:
    """Run the job from the command line; returns the exit code."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed one usage line
        return 0 if exc.code == 0 else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    options = Options(
        cache_dir=args.cache_dir, dry_run=args.dry_run, target=args.target,
        min_live=args.min_live, verify=args.verify, gc_only=args.gc_only,
        rebuild_index=args.rebuild_index, capacity=args.capacity,
        ring_dir=args.ring_dir, grace_s=args.grace, chunk_size=args.chunk_size,
    )  # fmt: skip
    try:
        if args.as_owner:
            act_as_owner(options.cache_dir)
        with _progress(enabled=not args.json) as progress:
            summary = run(options, progress)
    except (NpuKVError, OSError) as exc:
        print(f"{prog}: {printable(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(summary) | {"problems": summary.problems}))
    else:
        _print_summary(summary)
    return 1 if summary.problems else 0


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int], None]]:
    """A tqdm bar per step on a terminal; plain log lines otherwise."""
    bar = None
    tty = enabled and sys.stderr.isatty()

    def update(step: str, items: int) -> None:
        nonlocal bar
        if step:
            if bar is not None:
                bar.close()
                bar = None
            if tty:
                from tqdm import tqdm

                bar = tqdm(total=items, desc=step, unit="chunk", file=sys.stderr)
            elif enabled:
                logger.info("%s: %d items", step, items)
        elif bar is not None:
            bar.update(items)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def _print_summary(summary: Summary) -> None:
    verb = "would " if summary.dry_run else ""
    print(
        f"chunks {summary.chunks_before} -> {summary.chunks_after}, bytes "
        f"{summary.bytes_before} -> {summary.bytes_after} in {summary.seconds} s"
    )
    print(
        f"{verb}rewrite {summary.rewritten} chunks into {summary.written}, "
        f"{verb}evict {summary.evicted}; {verb}remove {summary.orphans_removed} "
        f"orphans, {summary.tmp_removed} tmp files, {summary.tombstones_cleared} "
        f"unlinked-late files, {summary.rings_removed} stale rings, drop "
        f"{summary.missing_dropped} rows of missing files; quarantine "
        f"{summary.quarantined}"
    )
    for line in summary.quarantined_chunks:
        print(f"quarantined {printable(line)}")
    if summary.calibration:
        print(f"read calibration of this disk: {summary.calibration}")
