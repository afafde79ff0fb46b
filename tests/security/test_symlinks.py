"""Symlinks planted in a cache directory (security review, finding 1): each
entry of the layout replaced by a link out of the directory, then gc, a
store open, ``verify --fix`` and ``rebuild-index`` each run. Each must leave
what the link points to byte-identical (and a missing target missing), and
either refuse with one ConfigError (exit 2) that names the entry, or treat
the link as foreign garbage (remove the link itself).

Before the fix: gc emptied a directory ``tmp`` pointed to, truncated the file
``maintenance.lock`` pointed to, created the missing file ``.lock`` pointed
to; a store open wrote into the LMDB database ``index`` pointed to, and
created one where ``claims`` pointed; verify --fix
moved chunks where ``quarantine`` pointed; and a link into a FIFO hung
every command that opened it.
"""

from __future__ import annotations

import os
import shutil

import lmdb
import pytest

from npukv_store.hashing import namespace_fingerprint
from tests.security import helpers
from tests.support import faults
from tests.support.chunks import chunk_files
from tests.support.faults import SMALL

NAMESPACE = namespace_fingerprint(SMALL).hex()
#: A name the chunk directory lists as a chunk: a victim an old gc deleted
VICTIM_CHUNK = "00000000000000aa.safetensors"


def _outside(base: str) -> str:
    """What an attacker points at: a precious file, a directory of files
    (one named like a chunk), a FIFO, and a path that does not exist."""
    out = os.path.join(base, "outside")
    os.makedirs(os.path.join(out, "dir", "chunks"))
    with open(os.path.join(out, "important.conf"), "w") as handle:
        handle.write("root's configuration\n")
    for name in ("dir/notes.txt", "dir/123-ab.tmp", f"dir/chunks/{VICTIM_CHUNK}"):
        with open(os.path.join(out, name), "w") as handle:
            handle.write(f"precious {name}\n")
    with open(os.path.join(out, "secret32"), "wb") as handle:
        handle.write(b"s" * 64)
    os.chmod(os.path.join(out, "secret32"), 0o600)
    os.mkfifo(os.path.join(out, "fifo"))
    os.mkdir(os.path.join(out, "empty"))
    # someone else's LMDB database: what an index link would point LMDB at
    env = lmdb.open(os.path.join(out, "lmdb"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"account", b"precious")
    env.close()
    return out


def _plant(root: str, entry: str, out: str) -> tuple[str, str]:
    """Replace ``entry`` of the cache by a link out of it; returns (the link,
    its target)."""
    ns_dir = os.path.join(root, NAMESPACE)
    chunk = sorted(chunk_files(root).values())[0]
    where, target = {
        "tmp": (os.path.join(root, "tmp"), os.path.join(out, "dir")),
        "maintenance.lock": (
            os.path.join(root, "maintenance.lock"), os.path.join(out, "important.conf"),
        ),
        ".lock": (os.path.join(root, ".lock"), os.path.join(out, "missing")),
        "sessions": (
            os.path.join(root, "sessions"), os.path.join(out, "important.conf"),
        ),
        "boot": (os.path.join(root, "boot"), os.path.join(out, "important.conf")),
        "quarantine": (os.path.join(root, "quarantine"), os.path.join(out, "empty")),
        "index": (os.path.join(root, "index"), os.path.join(out, "lmdb")),
        "claims": (os.path.join(root, "claims"), os.path.join(out, "empty")),
        "<ns>": (ns_dir, os.path.join(out, "dir")),
        "<ns>/chunks": (
            os.path.join(ns_dir, "chunks"), os.path.join(out, "dir", "chunks"),
        ),
        "a chunk file": (chunk, os.path.join(out, "fifo")),
        "secret": (os.path.join(root, "secret"), os.path.join(out, "secret32")),
        "NPUKV_STORE": (os.path.join(root, "NPUKV_STORE"), os.path.join(out, "fifo")),
    }[entry]  # fmt: skip
    if entry == "quarantine":  # something for verify --fix to move there
        faults.flip_bit(chunk, faults.data_start(chunk) + 3, 1)
    if os.path.isdir(where) and not os.path.islink(where):
        shutil.move(where, os.path.join(os.path.dirname(out), "moved-away"))
    elif os.path.lexists(where):
        os.unlink(where)
    os.symlink(target, where)
    return where, target


ENTRIES = [
    "tmp", "maintenance.lock", ".lock", "sessions", "boot", "quarantine", "index",
    "claims", "<ns>", "<ns>/chunks", "a chunk file", "secret", "NPUKV_STORE",
]  # fmt: skip


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_symlinked_entry_is_never_followed(attack, tmp_path, entry):
    root = str(tmp_path / "cache")
    rings = str(tmp_path / "shm")
    os.mkdir(rings)
    cfg = helpers.filled_cache(root)
    out = _outside(str(tmp_path))
    link, _ = _plant(root, entry, out)
    before = helpers.snapshot(out)
    for name, operation in helpers.operations(cfg, rings).items():
        with attack(f"symlink: {entry} -> outside, then {name}"):
            done = helpers.bounded(operation)
            assert done.kind != "hung", f"{name}: {done.detail} (followed into a FIFO)"
            if done.kind == "error":
                raise RuntimeError(f"{name}: {done.detail}")
            if done.kind == "refused":
                # one clear line, naming the entry (or the chunk's path)
                assert link in done.detail, f"{name}: {done.detail!r} names no {link}"
                assert "Traceback" not in done.detail, done.detail
            after = helpers.snapshot(out)
            assert after == before, (
                f"{name} changed what {entry} points to: "
                f"{sorted(set(after.items()) ^ set(before.items()))[:3]}"
            )
