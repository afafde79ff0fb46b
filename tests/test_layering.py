"""The import direction of docs/architecture.md, checked on every module's
imports: one rank per package, the two sides of the connector and of the store
apart, no import circle among the package's modules; and the promise that the
store layer works without torch or vllm installed."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "npukv_store"
#: package (or top-level module) -> rank, as docs/architecture.md draws the
#: arrows: a module imports its own package and packages of a LOWER rank only,
#: so two packages of one rank never import each other (io and store are 2 and
#: 3: io never imports store; cli and connector are both 5)
RANK = {
    "errors": 0, "spec": 0, "liveness": 0, "_native": 0, "_twin": 0,
    "native": 1, "config": 1, "hashing": 1, "keying": 1,
    "io": 2, "device": 2, "remote": 2, "config_reference": 2,
    "store": 3, "testing": 3,
    "maintenance": 4,
    "cli": 5, "connector": 5,
    "__init__": 6,  # npukv_store/__init__.py re-exports the store's API
}  # fmt: skip
#: the same inside a package: its subpackages and modules by rank ("" is every
#: other module at the package's top); siblings of one rank never import each
#: other (connector.worker never imports connector.scheduler, nor the reverse)
SUBRANK = {
    "connector": {
        "": 0, "scheduler": 1, "worker": 1, "connector": 2, "__init__": 3,
    },
    "store": {
        "": 0, "read": 1, "write": 1, "store": 2, "compaction": 3, "__init__": 3,
    },
    "cli": {"": 0, "__init__": 1, "__main__": 2},
}  # fmt: skip
HEAVY = {"torch", "vllm", "torch_npu", "vllm_ascend"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
KNOWN = set(MODULES) | {"npukv_store._native"}  # the C extension (a leaf)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports, at module level or inside functions, but
    not under ``if TYPE_CHECKING:`` (never run, so never part of a circle).
    ``from a import b`` names ``a.b`` where that is a module of the package."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _type_checking(node)
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append(full if full in KNOWN else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports. Built here with ast rather
    than grimp or import-linter: no venv of the CI lanes (scripts/test.sh)
    carries either, and this is the only place that needs one."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for module in imports_of(path):
            while module and module not in KNOWN:  # a name inside a module
                module = module.rpartition(".")[0]
            if module.startswith("npukv_store") and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def rank_of(module: str) -> tuple[str, int, str, int]:
    """(package, its rank, the part of it the module is in, that part's rank)
    of a package module; the part is a SUBRANK key (one of its subpackages or
    named modules, or "" for the rest), "" in a package without SUBRANK."""
    parts = module.split(".")[1:] or ["__init__"]
    package, inner = parts[0], SUBRANK.get(parts[0], {})
    part = "__init__" if len(parts) == 1 else parts[1]
    part = part if part in inner else ""
    return package, RANK[package], part, inner.get(part, 0)


def test_every_package_has_a_rank():
    assert {module.split(".")[1] for module in MODULES if "." in module} <= set(RANK)


def test_import_direction():
    bad = []
    for name, targets in sorted(import_graph().items()):
        package, rank, part, sub = rank_of(name)
        for target in sorted(targets):
            t_package, t_rank, t_part, t_sub = rank_of(target)
            if package != t_package and t_rank >= rank:
                bad.append(f"{name} imports {target}: rank {rank} -> {t_rank}")
            elif package == t_package and part != t_part and t_sub >= sub:
                bad.append(f"{name} imports {target}: {part} -> {t_part}")
    assert bad == []


def test_heavy_imports_stay_in_connector_and_device():
    """Only connector/ imports vllm; only connector/ and device/ import torch."""
    bad = []
    for name, path in MODULES.items():
        package = rank_of(name)[0]
        for module in imports_of(path):
            top = module.split(".")[0]
            if top in HEAVY and package not in {"connector", "device"}:
                bad.append(f"{name} imports {module}")
            if top in {"vllm", "vllm_ascend"} and package != "connector":
                bad.append(f"{name} imports {module}")
    assert bad == []


def test_remote_imports_only_config_spec_errors_native_keying():
    """The remote tier knows nothing of the store, I/O or devices: the
    connector wires it in (the store sees it as a RemoteSink)."""
    graph = import_graph()
    allowed = {"remote", "config", "spec", "errors", "native", "keying"}
    bad = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if rank_of(name)[0] == "remote"
        for target in targets
        if rank_of(target)[0] not in allowed
    ]
    assert bad == []
    store_imports = {
        rank_of(t)[0] for n, ts in graph.items() if rank_of(n)[0] == "store" for t in ts
    }
    assert "remote" not in store_imports


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module
    importing itself): every import circle, by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    """No module reaches itself through imports, counting imports inside
    functions (they run too) and not ``if TYPE_CHECKING:`` ones. A package's
    ``__init__`` that a submodule's import runs first is not an edge: Python
    has already started it, so it completes."""
    assert circles(import_graph()) == []


def test_circles_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e"]]


def test_store_works_without_torch(tmp_path):
    code = f"""
import sys
sys.modules["torch"] = None  # importing torch now fails
sys.modules["vllm"] = None
import numpy as np
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import tiny_spec, block_tensors, empty_blocks
store = KVStore(StoreConfig(cache_dir={str(tmp_path / "c")!r}), tiny_spec())
keys = store.keys_for(range(64))
store.put(keys, block_tensors(store.spec, keys))
assert store.read(keys, empty_blocks(store.spec, 4)) == [True] * 4
assert store.check(verify_data=True) == []
print("ok")
"""
    out = subprocess.run(  # from the repository root: tests is importable
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
