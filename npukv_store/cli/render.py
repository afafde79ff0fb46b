"""The ``npukv`` command's reports (:mod:`.reports`) as human text.

Runs in: the ``npukv`` process.

    stats_sections(), namespace_sections(), chunk_sections() - a report's text
    emit()          - print sections: rich tables when ``rich`` is installed (it
                      is optional; no colour when stdout is not a terminal),
                      else plain aligned text
    printable()     - a value with its control characters escaped

Every string a report holds may come from a file anyone who can write to the
cache wrote (chunk metadata such as the creator, namespace.json fields, tensor
and file names): emit() escapes every title, label and cell with printable(),
so a terminal never receives an escape sequence or BEL from them (security
review finding 10), whichever of the two renderers prints. ``--json`` needs
nothing more: json.dumps (ensure_ascii) writes every character outside
space..tilde, DEL and C1 included, as a \\uNNNN escape.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

#: Render with rich when it is importable; tests switch it off for the plain form.
USE_RICH = importlib.util.find_spec("rich") is not None
#: Width of rich output when stdout is a pipe or file: wide enough that log
#: files keep one line per namespace.
PIPE_WIDTH = 160
_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
#: What printable() escapes: C0 controls (ESC, BEL, CR, newline, tab too), DEL,
#: C1 controls (0x9b is a one-byte CSI on some terminals), the line and
#: paragraph separators and the bidirectional overrides and isolates, which
#: reorder what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


# -- escaping ------------------------------------------------------------------


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(value: object) -> str:
    """``str(value)`` with each character of :data:`_UNPRINTABLE` written as
    ``\\xNN`` (``\\uNNNN`` above 0xff): ``"a\\x1b[2J"`` prints as ``a\\x1b[2J``."""
    return _UNPRINTABLE.sub(_escape, value if isinstance(value, str) else str(value))


def _printable_section(section: Pairs | Table) -> Pairs | Table:
    if isinstance(section, Pairs):
        rows = [(printable(label), printable(value)) for label, value in section.rows]
        return Pairs(printable(section.title), rows)
    return Table(
        printable(section.title),
        [printable(header) for header in section.headers],
        [[printable(cell) for cell in row] for row in section.rows],
    )


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


def calibration_text(found: Mapping[str, Any] | None) -> str:
    """The first-read route and the cold speeds (GB/s) that chose it."""
    if not found:
        return "direct (constants: no calibration of this disk; npukv calibrate)"
    return (
        f"{found['first_reads']} (calibrated {utc(found['measured_ns'])}: "
        f"buffered {found['buffered_qd1']:.2f}/{found['buffered_qd16']:.2f}, "
        f"O_DIRECT {found['direct_qd1']:.2f}/{found['direct_qd16']:.2f} GB/s "
        "at QD1/QD16)"
    )


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
    if "read_calibration" in report:
        rows.append(("first reads", calibration_text(report["read_calibration"])))
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
    sections: list[Pairs | Table] = [
        Pairs(f"npukv stats {report['cache_dir']}", rows),
        Table("namespaces", [*headers, "bytes", "dead"], table),
    ]
    return sections + _tenant_sections(report) + _admission_sections(report)


def _tenant_sections(report: Mapping[str, Any]) -> list[Pairs | Table]:
    """The tenants (where more than the default one holds blocks, or shares
    are set) and the pins of ``npukv stats``."""
    sections: list[Pairs | Table] = []
    tenants = report.get("tenants") or {}
    if len(tenants) > 1 or any(t["share_bytes"] for t in tenants.values()):
        rows = [
            [
                name,
                human_bytes(entry["bytes"]),
                "-"
                if entry["share_bytes"] is None
                else human_bytes(entry["share_bytes"]),
                {True: "over", False: "under", None: "-"}[entry["over_share"]],
                f"{entry['chunks']:,}",
            ]
            for name, entry in tenants.items()
        ]
        sections.append(
            Table("tenants", ["tenant", "bytes", "share", "", "chunks"], rows)
        )
    pins = report.get("pins") or []
    if pins:
        rows = [
            [
                pin["pin"],
                str(pin.get("label") or pin.get("error", "")),
                pin.get("tenant", "?"),
                f"{pin.get('tokens', 0):,}",
                f"{pin.get('pinned_keys', 0):,}",
                _expiry(pin),
            ]
            for pin in pins
        ]
        title = (
            f"pins ({report['pinned_chunks']:,} chunks, "
            f"{exact_bytes(report['pinned_bytes'])} pinned)"
        )
        sections.append(
            Table(title, ["pin", "label", "tenant", "tokens", "keys", "expires"], rows)
        )
    return sections


#: (key, label) of the admission counters, blocks unless named bytes
_ADMISSION_ROWS = (
    ("admitted_blocks", "admitted blocks"),
    ("declined_blocks", "declined blocks"),
    ("lost_hit_blocks", "lost hits (declined, asked again)"),
    ("wasted_write_blocks", "wasted writes (evicted unread)"),
    ("written_bytes", "written"),
)


def _admission_sections(report: Mapping[str, Any]) -> list[Pairs | Table]:
    """The admission state and counters of ``npukv stats``, per tenant where
    more than one tenant has counters; none while the directory has no
    admission state (no server kept any: ``admission: all`` without a write
    budget keeps none)."""
    found = report.get("admission")
    if not found:
        return []
    tables = found.get("tables") or {}
    recorded = (
        found.get("tenants")
        or found.get("shadow_asks")
        or any(tables.values())
        or found.get("budget_left_bytes") is not None
    )
    if not recorded:
        return []
    rows = [
        ("auto's choice", str(found["auto_choice"])),
        (
            "shadow hits",
            f"write-all {found['shadow_hits_all']:,.1f}, second sight "
            f"{found['shadow_hits_second_sight']:,.1f} "
            f"of {found['shadow_asks']:,.1f} sampled asks",
        ),
        (
            "ghost",
            f"{found['ghost_blocks']:,} blocks remembered (scores from "
            f"{tables.get('processes', 0):,} processes)",
        ),
    ]
    if found.get("budget_left_bytes") is not None:
        left = int(found["budget_left_bytes"])
        rows.append(
            (
                "write budget left",
                f"{exact_bytes(max(left, 0))} at {utc(found['budget_updated_ns'])}",
            )
        )
    for key, label in _ADMISSION_ROWS:
        value = int(found.get(key, 0))
        rows.append(
            (label, exact_bytes(value) if key == "written_bytes" else f"{value:,}")
        )
    sections: list[Pairs | Table] = [Pairs("admission", rows)]
    tenants = found.get("tenants") or {}
    if len(tenants) > 1:
        table = [
            [
                name,
                *(f"{int(entry.get(key, 0)):,}" for key, _ in _ADMISSION_ROWS[:-1]),
                human_bytes(int(entry.get("written_bytes", 0))),
            ]
            for name, entry in tenants.items()
        ]
        headers = ["tenant", "admitted", "declined", "lost hits", "wasted", "written"]
        sections.append(Table("admission by tenant", headers, table))
    return sections


def _expiry(pin: Mapping[str, Any]) -> str:
    if pin.get("expired"):
        return "expired"
    return utc(pin["expires_ns"]) if pin.get("expires_ns") else "never"


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
    """Print ``sections`` to ``out`` (stdout by default), every string in them
    escaped by :func:`printable`."""
    stream = sys.stdout if out is None else out
    sections = [_printable_section(section) for section in sections]
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
