"""The import direction of docs/architecture.md, checked by walking every
module's imports, plus the promise that the store layer works without torch or
vllm installed."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npukv_store"
# rank: a module may import only packages of a lower or equal rank
RANK = {
    "errors": 0, "spec": 0, "config": 1,
    "hashing": 2, "layout": 2, "block_runs": 2, "store": 2, "io": 2, "device": 2,
    "remote": 2,
    "maintenance": 3, "cli": 4, "cli_render": 4, "connector": 5, "_native": 0,
    "native": 0, "_twin": 0,
    "liveness": 0,
}  # fmt: skip
HEAVY = {"torch", "vllm", "torch_npu", "vllm_ascend"}


def top_level(module: str) -> str:
    return module.split(".")[1] if module.startswith("npukv_store.") else ""


def imports_of(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_remote_imports_only_config_spec_errors_native():
    """The remote tier knows nothing of the store, I/O or devices: the
    connector wires it in (the store sees it as a RemoteSink)."""
    bad = []
    for path in sorted((PACKAGE / "remote").rglob("*.py")):
        for module in imports_of(path):
            target = top_level(module)
            if target and target not in (
                "remote",
                "config",
                "spec",
                "errors",
                "native",
            ):
                bad.append(f"{path.name} imports {module}")
    assert bad == []
    store_imports = {
        top_level(m) for p in (PACKAGE / "store").rglob("*.py") for m in imports_of(p)
    }
    assert "remote" not in store_imports


def test_import_direction():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        owner = rel.parts[0] if rel.parts[0] != "__init__" else "__init__"
        if owner == "__init__":
            continue
        for module in imports_of(path):
            target = top_level(module)
            if target and RANK[target] > RANK[owner]:
                bad.append(f"{rel} imports {module}")
            if module.split(".")[0] in HEAVY and owner not in {"connector", "device"}:
                bad.append(f"{rel} imports {module} (only connector/device may)")
    assert bad == []


def test_store_works_without_torch(tmp_path):
    code = f"""
import sys
sys.modules["torch"] = None  # importing torch now fails
sys.modules["vllm"] = None
import numpy as np
from npukv_store import KVStore, StoreConfig
sys.path.insert(0, {str(PACKAGE.parent)!r})
from tests.support.blocks import tiny_spec, block_tensors, empty_like_blocks
store = KVStore(StoreConfig(cache_dir={str(tmp_path / "c")!r}), tiny_spec())
keys = store.keys_for(range(64))
store.put(keys, block_tensors(store.spec, keys))
assert store.read(keys, empty_like_blocks(store.spec, 4)) == [True] * 4
assert store.check(verify_data=True) == []
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
