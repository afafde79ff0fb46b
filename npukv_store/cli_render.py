"""The reports of the ``npukv`` command (:mod:`npukv_store.cli`): built from a
cache directory, rendered as JSON or as human text.

Runs in: the ``npukv`` process; reads only (index snapshots, file headers).

    stats_report(), namespace_report(), chunk_report() - the ``--json`` dicts
    stats_sections(), namespace_sections(), chunk_sections() - the same as text
    emit()          - print sections: rich tables when ``rich`` is installed (it
                      is optional; no colour when stdout is not a terminal),
                      else plain aligned text
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from npukv_store.spec import NamespaceSpec
from npukv_store.store import policy
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import META_CREATED_NS, META_CREATOR, ChunkHeader
from npukv_store.store.index import ChunkRecord, Index

#: Render with rich when it is importable; tests switch it off for the plain form.
USE_RICH = importlib.util.find_spec("rich") is not None
#: Width of rich output when stdout is a pipe or file: wide enough that log
#: files keep one line per namespace.
PIPE_WIDTH = 160
_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


@dataclass
class Usage:
    """What the index says a set of chunks holds."""

    chunks: int = 0
    blocks: int = 0
    bytes: int = 0
    dead_bytes: int = 0
    oldest_ns: int | None = None
    newest_ns: int | None = None

    def add(self, record: ChunkRecord) -> None:
        self.chunks += 1
        self.blocks += record.live_rows
        self.bytes += record.size_bytes
        # about what compaction gets back by rewriting only the live rows
        self.dead_bytes += policy.dead_bytes(record)
        created = record.created_ns
        self.oldest_ns = min(created, self.oldest_ns or created)
        self.newest_ns = max(created, self.newest_ns or created)

    def as_dict(self) -> dict[str, int | None]:
        return {
            "chunks": self.chunks,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "dead_bytes": self.dead_bytes,
            "oldest_ns": self.oldest_ns,
            "newest_ns": self.newest_ns,
        }


def usage_by_namespace(cdir: CacheDir, index: Index) -> tuple[dict[str, Usage], Usage]:
    """Per namespace (on disk or in the index) and overall, from one snapshot."""
    per_ns = {ns: Usage() for ns in cdir.namespaces()}
    total = Usage()
    for record in index.iter_chunks():
        per_ns.setdefault(record.namespace.hex(), Usage()).add(record)
        total.add(record)
    return dict(sorted(per_ns.items())), total


def read_spec(cdir: CacheDir, namespace: str) -> NamespaceSpec | None:
    """The spec in ``<ns>/namespace.json``; None when missing or unreadable."""
    try:
        with open(os.path.join(cdir.ns_dir(namespace), "namespace.json")) as handle:
            return NamespaceSpec.from_json(handle.read())
    except (OSError, ValueError):
        return None


def spec_fields(spec: NamespaceSpec | None) -> dict[str, Any]:
    if spec is None:
        return dict.fromkeys(("model", "dtype", "block_size", "tp_rank", "tp_size"))
    return {
        "model": spec.model,
        "dtype": spec.kv_dtype,
        "block_size": spec.block_size,
        "tp_rank": spec.tp_rank,
        "tp_size": spec.tp_size,
    }


def stats_report(cdir: CacheDir, index: Index, capacity: int | None) -> dict[str, Any]:
    """The ``npukv stats --json`` object (docs/cli.md, "Reading npukv stats")."""
    per_ns, total = usage_by_namespace(cdir, index)
    default = os.path.join(cdir.root, "quarantine")
    quarantine = str(getattr(cdir, "quarantine_dir", default))
    quarantined = [e.stat().st_size for e in _scan(quarantine) if e.is_file()]
    report: dict[str, Any] = {
        "cache_dir": cdir.root,
        "capacity_bytes": capacity,
        "used_bytes": total.bytes,
        "live_bytes": total.bytes - total.dead_bytes,
        "dead_bytes": total.dead_bytes,
        "fragmentation": total.dead_bytes / total.bytes if total.bytes else 0.0,
        "chunks": total.chunks,
        "blocks": total.blocks,
        "oldest_ns": total.oldest_ns,
        "newest_ns": total.newest_ns,
        "quarantine_dir": quarantine if os.path.isdir(quarantine) else None,
        "quarantined_files": len(quarantined),
        "quarantined_bytes": sum(quarantined),
        "namespaces": {
            ns: {**spec_fields(read_spec(cdir, ns)), **usage.as_dict()}
            for ns, usage in per_ns.items()
        },
    }
    claims = claims_held(cdir, index)
    if claims is not None:
        report["claims"] = claims
    # Deprecated aliases, kept for one release (scripts/demo_vllm.py and
    # operators' scripts read them): use used_bytes, chunks and blocks.
    report["total_bytes"] = total.bytes
    report["num_chunks"] = total.chunks
    report["num_blocks"] = total.blocks
    return report


def _scan(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def claims_held(cdir: CacheDir, index: Index) -> int | None:
    """Save claims in the directory (None when it keeps none)."""
    held = getattr(index, "claims_held", None)
    if callable(held):
        return int(held())
    path = os.path.join(cdir.root, "claims")
    if not os.path.isdir(path):
        return None  # opening the table would create it: stats only reads
    from npukv_store.store.claims import ClaimTable

    table = ClaimTable(path)
    try:
        return table.held()
    finally:
        table.close()


def namespace_report(cdir: CacheDir, index: Index, namespace: str) -> dict[str, Any]:
    """The ``npukv inspect DIR NAMESPACE --json`` object: spec, layout, usage."""
    per_ns, _ = usage_by_namespace(cdir, index)
    spec = read_spec(cdir, namespace)
    report: dict[str, Any] = {"namespace": namespace, **spec_fields(spec)}
    if spec is not None:
        report.update(
            revision=spec.revision,
            pp_rank=spec.pp_rank,
            pp_size=spec.pp_size,
            rank_independent=spec.rank_independent,
            layout=layout(spec),
        )
    return {**report, **per_ns.get(namespace, Usage()).as_dict()}


def layout(spec: NamespaceSpec) -> dict[str, Any]:
    """Layers grouped by identical parts: most models have one group."""
    groups: dict[tuple[object, ...], dict[str, Any]] = {}
    for layer in spec.layers:
        shape = tuple((p.name, p.dtype, p.row_shape) for p in layer.parts)
        parts = [
            {"name": p.name, "dtype": p.dtype, "row_shape": list(p.row_shape),
             "row_bytes": p.row_bytes}
            for p in layer.parts
        ]  # fmt: skip
        group = groups.setdefault(
            shape, {"layer_count": 0, "row_bytes": layer.row_bytes, "parts": parts}
        )
        group["layer_count"] += 1
    return {
        "layers": len(spec.layers),
        "block_bytes": spec.block_bytes,
        "groups": list(groups.values()),
    }


def chunk_report(
    header: ChunkHeader, chunk_id: str | None, live_rows: int | None, keys: int
) -> dict[str, Any]:
    """The ``npukv inspect CHUNK_FILE --json`` object; ``live_rows`` is the
    index's (None when the index does not have the chunk)."""
    return {
        "path": os.path.abspath(header.path),
        "chunk_id": chunk_id,
        "file_size": header.file_size,
        "data_start": header.data_start,
        "namespace": header.namespace,
        "num_blocks": header.num_blocks,
        "live_rows": live_rows,
        "created_ns": int(header.metadata.get(META_CREATED_NS, "0") or 0),
        "creator": header.metadata.get(META_CREATOR),
        "checksums": list(header.checksums.shape),
        "keys": [k.hex() for k in header.keys[:keys]],
        "layers": {
            name: [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in entries]
            for name, entries in zip(header.layer_names, header.layers, strict=True)
        },
        "metadata": {k: v for k, v in header.metadata.items() if k != "npukv_keys"},
    }


# -- text ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pairs:
    """A titled block of ``label: value`` lines."""

    title: str
    rows: Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Table:
    """A titled table."""

    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[str]]


def human_bytes(count: int | None) -> str:
    """``1536`` -> ``1.50 KiB``; None -> ``unknown``."""
    if count is None:
        return "unknown"
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:.2f} {unit}"


def exact_bytes(count: int | None) -> str:
    """``1536`` -> ``1.50 KiB (1,536 bytes)``: readable, and exact for scripts."""
    if count is None:
        return "unknown"
    return f"{human_bytes(count)} ({count:,} bytes)"


def utc(ns: int | None) -> str:
    """Nanoseconds since the epoch as ISO 8601 UTC; ``-`` for none."""
    if not ns:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def _tp(entry: Mapping[str, Any]) -> str:
    if entry.get("tp_size") is None:
        return "?"
    return f"{entry['tp_rank']}/{entry['tp_size']}"


def stats_sections(report: Mapping[str, Any]) -> list[Pairs | Table]:
    """``npukv stats``: the totals, then one row per namespace."""
    capacity = report["capacity_bytes"]
    used = report["used_bytes"]
    used_text = exact_bytes(used)
    if capacity:
        used_text += f", {percent(used / capacity)} of capacity"
    rows = [
        ("capacity", exact_bytes(capacity)),
        ("used", used_text),
        ("live", exact_bytes(report["live_bytes"])),
        ("dead", exact_bytes(report["dead_bytes"])),
        ("fragmentation", f"{percent(report['fragmentation'])} of used is dead"),
        ("chunks", f"{report['chunks']:,}"),
        ("blocks", f"{report['blocks']:,}"),
        ("namespaces", f"{len(report['namespaces'])}"),
        ("oldest entry", utc(report["oldest_ns"])),
        ("newest entry", utc(report["newest_ns"])),
    ]
    if "claims" in report:
        rows.append(("save claims", f"{report['claims']:,}"))
    if report.get("quarantine_dir"):
        rows.append(
            (
                "quarantined",
                f"{report['quarantined_files']} files, "
                f"{exact_bytes(report['quarantined_bytes'])}",
            )
        )
    table = [
        [
            ns[:12],
            str(entry.get("model") or "?"),
            str(entry.get("dtype") or "?"),
            str(entry.get("block_size") or "?"),
            _tp(entry),
            f"{entry['chunks']:,}",
            f"{entry['blocks']:,}",
            human_bytes(entry["bytes"]),
            human_bytes(entry["dead_bytes"]),
        ]
        for ns, entry in report["namespaces"].items()
    ]
    headers = ["namespace", "model", "dtype", "block", "TP", "chunks", "blocks"]
    return [
        Pairs(f"npukv stats {report['cache_dir']}", rows),
        Table("namespaces", [*headers, "bytes", "dead"], table),
    ]


def namespace_sections(report: Mapping[str, Any]) -> list[Pairs | Table]:
    """``npukv inspect DIR NAMESPACE``: the spec, its layout and its usage."""
    layout = report.get("layout")
    model = str(report.get("model") or "? (namespace.json unreadable)")
    if report.get("revision"):
        model += f" @ {report['revision']}"
    rows = [
        ("namespace", report["namespace"]),
        ("model", model),
        ("dtype", str(report.get("dtype") or "?")),
        ("block size", f"{report.get('block_size') or '?'} tokens"),
        ("TP rank/size", _tp(report)),
    ]
    if layout is not None:
        rows.append(("layers", str(layout["layers"])))
        for group in layout["groups"]:
            parts = ", ".join(
                f"{p['name']} {p['dtype']} {p['row_shape']} {p['row_bytes']:,} B"
                for p in group["parts"]
            )
            rows.append((f"parts ({group['layer_count']} layers)", parts))
            rows.append(("row bytes", f"{group['row_bytes']:,} per layer"))
        rows.append(("block bytes", f"{layout['block_bytes']:,}"))
    rows += [
        ("chunks", f"{report['chunks']:,}"),
        ("blocks", f"{report['blocks']:,}"),
        ("bytes", exact_bytes(report["bytes"])),
        ("dead", exact_bytes(report["dead_bytes"])),
        ("oldest entry", utc(report["oldest_ns"])),
        ("newest entry", utc(report["newest_ns"])),
    ]
    return [Pairs(f"namespace {report['namespace']}", rows)]


def chunk_sections(report: Mapping[str, Any]) -> list[Pairs | Table]:
    """``npukv inspect [DIR] CHUNK_FILE``: the header, tensors and first keys."""
    live = report["live_rows"]
    rows, cols = report["checksums"]
    pairs = [
        ("path", report["path"]),
        ("namespace", report["namespace"]),
        ("blocks", str(report["num_blocks"])),
        (
            "live rows",
            "not in the index" if live is None else f"{live} (per the index)",
        ),
        ("file size", exact_bytes(report["file_size"])),
        ("data start", f"{report['data_start']:,}"),
        ("created", utc(report["created_ns"])),
        ("creator", str(report["creator"])),
        ("checksums", f"U64 [{rows} rows x {cols} layers]"),
    ]
    tensors = [
        [name, dtype, str(shape), f"{begin:,}-{end:,}"]
        for entries in report["layers"].values()
        for name, dtype, shape, begin, end in entries
    ]
    keys = [[str(row), key] for row, key in enumerate(report["keys"])]
    sections: list[Pairs | Table] = [
        Pairs(f"chunk {report['chunk_id'] or '?'}", pairs),
        Table("tensors", ["tensor", "dtype", "shape", "file offsets"], tensors),
        Table(f"first {len(keys)} keys", ["row", "key"], keys),
    ]
    if "read_plan" in report:
        lines = [[line] for line in report["read_plan"]]
        sections.append(Table("read plan (first read, now)", ["route"], lines))
    return sections


def emit(sections: Sequence[Pairs | Table], out: TextIO | None = None) -> None:
    """Print ``sections`` to ``out`` (stdout by default)."""
    stream = sys.stdout if out is None else out
    if USE_RICH:
        _emit_rich(sections, stream)
    else:
        _emit_plain(sections, stream)


def _emit_rich(sections: Sequence[Pairs | Table], out: TextIO) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable
    from rich.text import Text

    width = None if out.isatty() else PIPE_WIDTH
    console = Console(file=out, width=width, highlight=False)
    for section in sections:
        title = Text(section.title, style="bold")
        if isinstance(section, Pairs):
            table = RichTable(show_header=False, box=None, padding=(0, 2))
            table.add_column(style="bold")
            table.add_column()
            rows: Sequence[Sequence[str]] = section.rows
        else:
            table = RichTable(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
            for header in section.headers:
                table.add_column(header)
            rows = section.rows
        for row in rows:  # Text: values like "[16, 2, 8]" are not rich markup
            table.add_row(*(Text(cell) for cell in row))
        with console.capture() as captured:
            console.print(title)
            console.print(table)
        # rich pads every line to the table's width: not in logs and pipes
        out.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
        out.write("\n")


def _emit_plain(sections: Sequence[Pairs | Table], out: TextIO) -> None:
    for section in sections:
        out.write(f"{section.title}\n")
        if isinstance(section, Pairs):
            width = max((len(label) for label, _ in section.rows), default=0)
            for label, value in section.rows:
                out.write(f"  {label.ljust(width)}  {value}\n")
        else:
            grid = [list(section.headers), *map(list, section.rows)]
            widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
            for row in grid:
                cells = (cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                out.write("  " + "  ".join(cells).rstrip() + "\n")
        out.write("\n")
