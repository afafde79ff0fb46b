"""One report frame for every benchmark.

    parse_args(name, add_args, argv)  the benchmark's arguments: its own
                    (``add_args``), ``--quick`` and ``--json PATH``
    Report          the header, the benchmark's own keys (``data``) and its
                    exit status; json(), write_json()
    table()         a fixed-width text table, the one the benchmarks print
    pct()           a percentile (linear between ranks: numpy's default)
    gbps()          decimal GB per second
    ratio()         a figure over its baseline measured in the same run

The header opens every JSON report, the same keys in every benchmark:
``{"bench", "commit", "host", "kernel", "cpus", "quick", "argv"}``
(``python -m bench BENCH ARGV...`` reproduces the run); the benchmark's own
keys follow it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import host

HEADER_KEYS = ("bench", "commit", "host", "kernel", "cpus", "quick", "argv")


def parse_args(
    name: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    argv: Sequence[str],
    description: str = "",
) -> argparse.Namespace:
    """The arguments of benchmark ``name``: ``--quick``, ``--json PATH`` and
    what ``add_args`` adds; ``bench`` and ``argv`` are kept for the header."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench {name}", description=description
    )
    parser.add_argument("--quick", action="store_true", help="the short form")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    add_args(parser)
    args = parser.parse_args(list(argv))
    args.bench, args.argv = name, list(argv)
    return args


class Report:
    """One run's report: the header (taken when the run starts: the commit
    is the code this process imported), then ``data``, the benchmark's keys.

    ``exit_code``: the process's (a benchmark whose targets failed may say
    1). ``hard_exit``: leave with ``os._exit`` once the report is written,
    for a benchmark whose libraries keep closing on daemon threads that an
    interpreter shutdown could crash (Mooncake against a dead master).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.header: dict[str, Any] = {
            "bench": args.bench,
            "commit": host.commit(),
            **host.facts(),
            "quick": bool(getattr(args, "quick", False)),
            "argv": list(args.argv),
        }
        self.data: dict[str, Any] = {}
        self.exit_code = 0
        self.hard_exit = False

    def json(self) -> dict[str, Any]:
        """The header, then the benchmark's keys."""
        clash = set(self.header) & set(self.data)
        assert not clash, f"benchmark keys shadow the header: {sorted(clash)}"
        return {**self.header, **self.data}

    def write_json(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.json(), indent=2) + "\n")


def table(
    head: Sequence[str], rows: Iterable[Sequence[object]], align: str = ""
) -> str:
    """``head`` over ``rows``, a rule between, each column as wide as its
    widest cell. ``align`` has one ``<`` or ``>`` per column (default: the
    first column left, the others right); a row of one cell is a caption
    spanning the table (a group's title)."""
    titles = [str(cell) for cell in head]
    lines = [[str(cell) for cell in row] for row in rows]
    align = align or "<" + ">" * (len(titles) - 1)
    widths = [len(cell) for cell in titles]
    for cells in lines:
        if len(cells) > 1:
            widths = [max(w, len(c)) for w, c in zip(widths, cells, strict=True)]

    def line(cells: list[str]) -> str:
        if len(cells) == 1 and len(titles) > 1:
            return cells[0]
        return "  ".join(
            f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)
        ).rstrip()

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    return "\n".join([line(titles), rule, *(line(cells) for cells in lines)])


def pct(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values``, linear between the two
    nearest ranks (numpy's default percentile; q=0.5 is the median).
    ValueError on no values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("pct of no values")
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB per second (payload bytes over wall time)."""
    return nbytes / seconds / 1e9


def ratio(value: float, baseline: float) -> float:
    """``value`` over ``baseline``, its reference measured in the same run;
    0.0 where no baseline was measured (zero)."""
    return value / baseline if baseline > 0 else 0.0
