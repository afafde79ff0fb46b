"""The operator's command line: ``npukv stats|inspect|verify|rebuild-index``.

Runs in: an operator's shell, beside live servers. Every command is safe while
servers use the directory: reads take MVCC snapshots, ``verify --fix`` only
removes crash leftovers no live process can still publish, and
``rebuild-index`` holds the directory lock that opening processes take.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence

from npukv_store.config import StoreConfig
from npukv_store.errors import NpuKVError
from npukv_store.store import recovery
from npukv_store.store.check import check_store
from npukv_store.store.directory import MARKER, CacheDir
from npukv_store.store.format import parse_header
from npukv_store.store.index import Index


def _open(cache_dir: str) -> tuple[CacheDir, Index, StoreConfig]:
    config = StoreConfig(cache_dir=cache_dir)
    cdir = CacheDir(cache_dir)
    if not os.path.exists(os.path.join(cdir.root, MARKER)):
        raise NpuKVError(f"{cdir.root}: no {MARKER} marker; expected an npukv cache")
    cdir.read_marker()
    with cdir.locked():
        index = recovery.open_index(cdir, map_size=config.index_map_size, sync=True)
    return cdir, index, config


def cmd_stats(args: argparse.Namespace) -> int:
    """Directory-wide totals and per-namespace chunk counts, as JSON."""
    cdir, index, _ = _open(args.cache_dir)
    total, chunks, blocks = index.totals()
    per_ns: Counter[str] = Counter()
    per_ns_bytes: Counter[str] = Counter()
    for record in index.iter_chunks():
        per_ns[record.namespace.hex()] += 1
        per_ns_bytes[record.namespace.hex()] += record.size_bytes
    report = {
        "cache_dir": cdir.root,
        "total_bytes": total,
        "num_chunks": chunks,
        "num_blocks": blocks,
        "namespaces": {
            ns: {"chunks": per_ns[ns], "bytes": per_ns_bytes[ns]}
            for ns in sorted(per_ns)
        },
    }
    index.close()
    print(json.dumps(report, indent=1))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """A chunk file's header: metadata, tensors and checksum table shape."""
    fd = os.open(args.chunk, os.O_RDONLY)
    try:
        header = parse_header(fd, args.chunk)
    finally:
        os.close(fd)
    report = {
        "path": header.path,
        "file_size": header.file_size,
        "data_start": header.data_start,
        "namespace": header.namespace,
        "num_blocks": header.num_blocks,
        "keys": [k.hex() for k in header.keys[: args.keys]],
        "layers": {
            name: [[e.name, e.dtype, list(e.shape)] for e in entries]
            for name, entries in zip(header.layer_names, header.layers, strict=True)
        },
        "metadata": {k: v for k, v in header.metadata.items() if k != "npukv_keys"},
    }
    print(json.dumps(report, indent=1))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """check() over the whole directory; exit 1 when a problem is found."""
    cdir, index, config = _open(args.cache_dir)
    problems = check_store(cdir, index, config, verify_data=not args.fast, fix=args.fix)
    index.close()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in {cdir.root}")
    return 1 if problems else 0


def cmd_rebuild_index(args: argparse.Namespace) -> int:
    """Rebuild the index from the chunk files' metadata."""
    config = StoreConfig(cache_dir=args.cache_dir)
    cdir = CacheDir(args.cache_dir)
    cdir.read_marker()
    with cdir.locked():
        index = recovery.rebuild_index(cdir, map_size=config.index_map_size, sync=True)
    total, chunks, blocks = index.totals()
    index.close()
    print(f"rebuilt {cdir.index_path}: {chunks} chunks, {blocks} blocks, {total} bytes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npukv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stats = sub.add_parser("stats", help=cmd_stats.__doc__)
    stats.add_argument("cache_dir")
    stats.set_defaults(func=cmd_stats)
    inspect = sub.add_parser("inspect", help=cmd_inspect.__doc__)
    inspect.add_argument("chunk")
    inspect.add_argument("--keys", type=int, default=4, help="keys to list")
    inspect.set_defaults(func=cmd_inspect)
    verify = sub.add_parser("verify", help=cmd_verify.__doc__)
    verify.add_argument("cache_dir")
    verify.add_argument("--fast", action="store_true", help="skip data checksums")
    verify.add_argument("--fix", action="store_true", help="remove crash leftovers")
    verify.set_defaults(func=cmd_verify)
    rebuild = sub.add_parser("rebuild-index", help=cmd_rebuild_index.__doc__)
    rebuild.add_argument("cache_dir")
    rebuild.set_defaults(func=cmd_rebuild_index)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``npukv`` command; bad input is one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (NpuKVError, OSError) as exc:
        print(f"npukv {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
