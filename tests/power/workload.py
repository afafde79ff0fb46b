"""The power-loss harness's two sides that run a store: the workload (run in
a child process on the recording mount) and the check of one crash state (run
in a fresh process per state).

    python -m tests.power.workload CACHE_DIR TAG CHUNKS
        open a KVStore on CACHE_DIR (fsync=chunk), put CHUNKS chunks of
        BLOCKS blocks (keys from ``TAG:<c>``) and, after each put() returned
        with every block stored, stat ``CACHE_DIR/.power-mark-TAG:<c>`` (the
        mount records the mark in order with the operations); close.

    check_state(root, committed, attempted) -> Verdict
        open a fresh KVStore on a materialised crash state and check it.

Block bytes are a function of the key (tests/support/blocks.py): any process
tells right bytes from wrong ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import traceback
from dataclasses import dataclass, field

from npukv_store import KVStore, StoreConfig
from tests.power.recordfs import MARK_PREFIX
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec, verify_read

SPEC = tiny_spec(num_layers=2)
BLOCKS = 4  # per chunk: 4 blocks x 2 layers x 2 parts x 512 B


#: The workloads the power-loss tests record (issue 40 part 2): each a list of
#: steps, each step the workload processes run together (their arguments
#: after CACHE_DIR); the next step starts when a step's processes all exit 0.
WORKLOADS: dict[str, list[list[tuple[str, ...]]]] = {
    # first open of a new directory (marker, secret, index, sessions,
    # namespace) and 3 publishes by one process
    "one-process": [[("a", "3")]],
    # a first process, then two publishing together on the same directory
    "two-processes": [[("a", "1")], [("b", "2"), ("c", "2")]],
}


def keys_for(label: str) -> list[bytes]:
    return [
        hashlib.blake2b(f"{label}:{i}".encode(), digest_size=16).digest()
        for i in range(BLOCKS)
    ]


def config(cache_dir: str) -> StoreConfig:
    return StoreConfig(
        cache_dir=cache_dir, capacity="64MiB", ring_size="4MiB", fsync="chunk",
        index_map_size="64MiB",
    )  # fmt: skip


#: NPUKV_POWER_MUTATION names a module whose os.fsync becomes a no-op in the
#: workload: the mutation tests' way to remove a sync and see a state lose data
MUTABLE = {
    "chunk-fsync": "npukv_store.store.write.chunk_file",
    "namespace-fsync": "npukv_store.store.directory",
    "dir-fsync": "npukv_store.store.dirfd",
}


class _NoFsync:
    """``os`` less fsync."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        del fd


def run(cache_dir: str, tag: str, chunks: int) -> None:
    mutation = os.environ.get("NPUKV_POWER_MUTATION", "")
    if mutation:
        importlib.import_module(MUTABLE[mutation]).os = _NoFsync()
    store = KVStore(config(cache_dir), SPEC)
    try:
        store.keys_for([1, 2, 3] * SPEC.block_size)  # the secret, made on first use
        for c in range(chunks):
            label = f"{tag}:{c}"
            keys = keys_for(label)
            result = store.put(keys, block_tensors(SPEC, keys))
            assert result.stored == len(keys), result
            with contextlib.suppress(FileNotFoundError):
                os.stat(os.path.join(cache_dir, MARK_PREFIX + label))
    finally:
        store.close()


@dataclass
class Verdict:
    lost: list[str] = field(default_factory=list)  # committed, not read back
    wrong: list[str] = field(default_factory=list)  # served with wrong bytes
    refused: str = ""  # the open (or a read, or check) raised
    problems: list[str] = field(default_factory=list)  # check() after the open


def check_state(root: str, committed: list[str], attempted: list[str]) -> Verdict:
    """Open ``root`` with a fresh KVStore: every block of a ``committed``
    chunk reads back byte-exact, no block of any ``attempted`` chunk reads back
    wrong, and check() finds nothing after the open."""
    verdict = Verdict()
    try:
        store = KVStore(config(root), SPEC)
    except Exception:
        verdict.refused = traceback.format_exc(limit=4)
        return verdict
    try:
        for label in attempted:
            keys = keys_for(label)
            out = empty_blocks(SPEC, len(keys))
            hits = store.read(keys, out)
            bad = verify_read(SPEC, keys, out, hits)
            if bad:
                verdict.wrong.append(f"{label}: rows {bad}")
            if label in committed and not all(hits):
                verdict.lost.append(f"{label}: hits {hits}")
        verdict.problems = store.check()
    except Exception:
        verdict.refused = traceback.format_exc(limit=4)
    finally:
        store.close()
    return verdict


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
