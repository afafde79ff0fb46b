"""The power-loss harness's workloads: run in child processes on the recording
mount (tests/power/harness.py), each saying what it did with marks.

    python -m tests.power.workload CACHE_DIR KIND TAG N

KIND is one of :data:`KINDS`. Each process opens a KVStore on CACHE_DIR
(fsync=chunk) and, at each point that sets an expectation, stats
``CACHE_DIR/.power-mark-<name>``: the mount records the mark in order with the
operations, so a crash state knows which of them had returned
(tests/power/checks.py reads them):

    config:<kind>     first, always: the configuration the check opens with
    put:<label>       a put() of chunk <label> returned with every block stored
    begin:<label>     a put() that may evict is about to start
    gone:<x>@<label>  chunk <x> was evicted by the put() of <label>
    pinned:<label>    a pin of chunk <label>'s keys was recorded and applied
    unpin:<label>     that pin's removal is about to start
    step:<what>       a maintenance step is about to start (informational)

Block bytes are a function of the key (tests/support/blocks.py): any process
tells right bytes from wrong ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys

from npukv_store import KVStore, StoreConfig
from npukv_store import maintenance as maintenance_job
from npukv_store.store.pins import PinRecord
from tests.power.recordfs import MARK_PREFIX
from tests.support.blocks import block_tensors, tiny_spec

SPEC = tiny_spec(num_layers=2)
BLOCKS = 4  # per chunk: 4 blocks x 2 layers x 2 parts x 512 B (12,352 B a file)
#: the eviction kinds' capacity: 4 chunks of 12,352 B, so the 5th evicts
SMALL_CAPACITY = "50KiB"
#: the salt of the second tenant of the ``tenants`` kind (each tenant has half)
TENANT_SALT = "tenant-b"

#: The workloads the power-loss tests record (issue 40 part 2): each a list of
#: steps, each step the workload processes run together (their arguments
#: after CACHE_DIR); the next step starts when a step's processes all exit 0.
WORKLOADS: dict[str, list[list[tuple[str, ...]]]] = {
    # first open of a new directory (marker, secret, index, sessions, boot,
    # namespace) and 3 publishes by one process
    "one-process": [[("put", "a", "3")]],
    # a first process, then two publishing together on the same directory
    "two-processes": [[("put", "a", "1")], [("put", "b", "2"), ("put", "c", "2")]],
    # puts past capacity: LRU eviction, deferred unlinks, the removal log
    "eviction": [[("evict", "a", "7")]],
    # a pin, puts past capacity (the pinned chunk stays), an unpin, more puts
    "pin-unpin": [[("pins", "a", "7")]],
    # two tenants, one with a share, past capacity: the tenant ledger
    "tenants": [[("tenants", "a", "7")]],
    # small chunks, then the maintenance job: compaction's merge and rewrite,
    # calibration.json, gc
    "compaction": [[("put", "a", "4")], [("maintain", "m", "0")]],
    # chunks, an index rebuild (npukv rebuild-index), then more publishes
    "rebuild": [[("put", "a", "2")], [("rebuild", "r", "0")], [("put", "b", "2")]],
}


def keys_for(label: str) -> list[bytes]:
    return [
        hashlib.blake2b(f"{label}:{i}".encode(), digest_size=16).digest()
        for i in range(BLOCKS)
    ]


def config(cache_dir: str, kind: str = "put") -> StoreConfig:
    """The store's configuration for a workload ``kind`` (the check opens
    with the same)."""
    if kind in ("evict", "pins", "tenants"):
        shares = {"": 0.5, TENANT_SALT: 0.5} if kind == "tenants" else {}
        return StoreConfig(
            cache_dir=cache_dir, capacity=SMALL_CAPACITY, ring_size="4MiB",
            fsync="chunk", index_map_size="64MiB", admission="all",
            tenant_shares=shares,
        )  # fmt: skip
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


class Run:
    """One workload process: a store on ``cache_dir`` and its marks."""

    def __init__(self, cache_dir: str, kind: str) -> None:
        self.cache_dir, self.kind = cache_dir, kind
        self.mark(f"config:{config_kind(kind)}")
        self.store = KVStore(config(cache_dir, config_kind(kind)), SPEC)
        self.store.keys_for([1, 2, 3] * SPEC.block_size)  # the secret, made on use
        self.live: list[str] = []  # this process's chunks not seen evicted

    def mark(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.stat(os.path.join(self.cache_dir, MARK_PREFIX + name))

    def put(
        self, label: str, tenant: bytes | None = None, evicts: bool = False
    ) -> None:
        keys = keys_for(label)
        if evicts:
            self.mark(f"begin:{label}")
        kwargs = {} if tenant is None else {"tenant": tenant}
        result = self.store.put(keys, block_tensors(SPEC, keys), **kwargs)
        assert result.stored == len(keys), result
        self.mark(f"put:{label}")
        if evicts:
            for old in list(self.live):
                if not self.stored(old):
                    self.live.remove(old)
                    self.mark(f"gone:{old}@{label}")
        self.live.append(label)

    def stored(self, label: str) -> bool:
        """Whether every block of chunk ``label`` is in the index (looked up
        without a touch: present() would move it up the LRU and change what
        the next put evicts)."""
        return all(loc is not None for loc in self.store.index.locate(keys_for(label)))

    def close(self) -> None:
        self.store.close()


def config_kind(kind: str) -> str:
    """The configuration a process kind opens with (``config``'s kind)."""
    return kind if kind in ("evict", "pins", "tenants") else "put"


def run(cache_dir: str, kind: str, tag: str, count: int) -> None:
    mutation = os.environ.get("NPUKV_POWER_MUTATION", "")
    if mutation:
        importlib.import_module(MUTABLE[mutation]).os = _NoFsync()
    if kind == "maintain":
        return _maintain(cache_dir)
    if kind == "rebuild":
        return _rebuild(cache_dir)
    work = Run(cache_dir, kind)
    try:
        if kind == "put":
            for c in range(count):
                work.put(f"{tag}:{c}")
        elif kind in ("evict", "tenants"):
            other = work.store.tenant(TENANT_SALT)
            for c in range(count):
                # tenants: every other chunk the share-holding tenant's
                tenant = other if kind == "tenants" and c % 2 else None
                work.put(f"{tag}:{c}", tenant=tenant, evicts=True)
        elif kind == "pins":
            _pins(work, tag, count)
        else:
            raise SystemExit(f"workload kind: found {kind!r}, expected one of {KINDS}")
    finally:
        work.close()


def _pins(work: Run, tag: str, count: int) -> None:
    """Pin the first chunk, fill past capacity (it must stay), unpin it, and
    fill again (it may go)."""
    first = f"{tag}:0"
    work.put(first, evicts=True)
    # (a pin names a prompt by its digests; which prompt does not matter here:
    # the keys are pinned directly, as a server does on a matching request)
    record = PinRecord.new([bytes(16)], work.store.tenant(None), label=first)
    index = work.store.index
    index.add_pin(record.pin_id, record.to_json())
    assert index.pin_keys(record.pin_id, keys_for(first)) is not None
    work.mark(f"pinned:{first}")
    half = count // 2
    for c in range(1, half + 1):
        work.put(f"{tag}:{c}", evicts=True)
        assert work.stored(first), "a pinned chunk was evicted"
    work.mark(f"unpin:{first}")
    assert index.unpin(record.pin_id)
    for c in range(half + 1, count):
        work.put(f"{tag}:{c}", evicts=True)


def _maintain(cache_dir: str) -> None:
    """The maintenance job: calibration (a 1 MiB sample, not 64: every byte
    goes through the recording mount), then compaction merges the small
    chunks, and gc."""
    maintenance_job.CALIBRATION_SAMPLE = 1 << 20
    with contextlib.suppress(FileNotFoundError):
        os.stat(os.path.join(cache_dir, MARK_PREFIX + "step:maintain"))
    summary = maintenance_job.run(
        maintenance_job.Options(
            cache_dir=cache_dir, ring_dir=_rings(cache_dir), min_live=0.99
        )
    )
    assert summary.written >= 1, summary  # compaction merged: it rewrote
    assert summary.problems == 0, summary


def _rebuild(cache_dir: str) -> None:
    """``npukv rebuild-index``: a fresh index from the chunk files."""
    with contextlib.suppress(FileNotFoundError):
        os.stat(os.path.join(cache_dir, MARK_PREFIX + "step:rebuild"))
    summary = maintenance_job.run(
        maintenance_job.Options(
            cache_dir=cache_dir, ring_dir=_rings(cache_dir), rebuild_index=True,
            gc_only=True,
        )
    )  # fmt: skip
    assert summary.problems == 0, summary


def _rings(cache_dir: str) -> str:
    """An empty ring directory for the job's ring sweep (beside the mount:
    never /dev/shm, where other tests' rings live)."""
    path = cache_dir.rstrip("/") + "-rings"
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


KINDS = ("put", "evict", "tenants", "pins", "maintain", "rebuild")


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
