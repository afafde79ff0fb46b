"""``python -m bench NAME [--quick] [--json PATH] ...`` runs one benchmark;
``python -m bench`` lists them, each with its docstring's first line.

A benchmark is a module of this package that defines ``add_args(parser)`` and
``run(args) -> Report`` (bench/report.py): it is found by reading the sources,
not by importing them, so the list shows even where a benchmark's libraries
(vLLM, Mooncake, torch) are missing, and a new benchmark is one new file.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import report

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """name -> the first line of its docstring, for every benchmark module."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if {"add_args", "run"} <= defined:
            doc = ast.get_docstring(tree) or ""
            found[path.stem] = " ".join(doc.split("\n\n")[0].split())
    return found


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m bench NAME [--quick] [--json PATH] [options]\n")
        width = max(map(len, names))
        for name, line in names.items():
            print(f"  {name:<{width}}  {line}")
        print("\npython -m bench NAME --help: the options of one")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        expected = ", ".join(names)
        print(
            f"python -m bench: found {name!r}, expected one of: {expected}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(f"bench.{name}")
    args = report.parse_args(name, module.add_args, rest, names[name])
    result: report.Report = module.run(args)
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    if result.hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    return result.exit_code


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())
