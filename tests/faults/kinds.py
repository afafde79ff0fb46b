"""The fault kinds: what each test injects, which promise it checks, and what
must happen. One entry per distinct fault; docs/faults.md lists the same table
(a test keeps them in step).

The promises (README, docs/faults.md):

    P1  never serve wrong KV: any doubt is a miss (the blocks are recomputed),
        and a fault in this package never crashes the serving process
    P2  never slow inference down: saves are asynchronous, a full ring drops
        the save and counts it, a failing save is counted and serving goes on
    P3  nothing durable is lost, nothing torn is visible: a process killed at
        any instant leaves the directory consistent for every other process
    P4  bad input gets one clear error naming what was found and what was
        expected (config, files, headers, wrong model, unusable directory),
        or a documented degraded mode; never a raw traceback

Extension point: a new kind is one :func:`kind` call here (or in any module
imported before collection, e.g. a maintenance test module) plus a test marked
``@pytest.mark.fault("<name>")`` that takes the ``fault`` fixture (see
tests/faults/conftest.py). The compaction faults (SIGKILL of the maintenance
job in each of its windows) belong here once npukv_store/maintenance.py lands.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMISES = ("P1", "P2", "P3", "P4")


@dataclass(frozen=True)
class Kind:
    promise: str
    fault: str  # what is injected
    expected: str  # what must happen
    full_only: bool = False  # runs only in the full form (-m faults): real vLLM


KINDS: dict[str, Kind] = {}


def kind(
    name: str, promise: str, fault: str, expected: str, *, full_only: bool = False
) -> None:
    """Register a fault kind (names are unique; the promise is one of P1-P4)."""
    if name in KINDS:
        raise ValueError(f"fault kind {name!r} registered twice")
    if promise not in PROMISES:
        raise ValueError(f"fault kind {name!r}: promise {promise!r}, expected P1-P4")
    KINDS[name] = Kind(promise, fault, expected, full_only)


# -- disk space and failing writes ---------------------------------------------

kind(
    "enospc-tmpfs-put",
    "P3",
    "put() on a real 8 MiB tmpfs until it is full",
    "put raises OSError(ENOSPC); no tmp file or torn chunk is left; every block "
    "stored before reads back; puts succeed again once space is freed",
)
kind(
    "enospc-tmpfs-save",
    "P2",
    "put_async() (the connector's save path) on a full 8 MiB tmpfs",
    "put_async never raises or waits; the writer counts the failed batch "
    "(failed_batches) and goes on; saving resumes when space returns; nothing "
    "stored is lost",
)
kind(
    "enospc-fsync",
    "P3",
    "os.fsync of the chunk's tmp file fails with ENOSPC",
    "the batch is counted failed, its tmp file removed, nothing published; "
    "the next saves succeed",
)
kind(
    "enospc-rename",
    "P3",
    "os.rename of tmp/ into chunks/ fails with ENOSPC",
    "as enospc-fsync: nothing published, nothing left, saving goes on",
)
kind(
    "enospc-engine-write",
    "P2",
    "NPUKV_FAULTS=write:enospc: the background writer's engine fails writes",
    "failed batches counted, put_async never raises; once the fault stops "
    "(count=N) saves publish again",
)
kind(
    "short-write",
    "P3",
    "NPUKV_FAULTS=write:short: writes move only half their bytes",
    "the short write is detected, the batch fails and is counted; no torn "
    "chunk is ever visible",
)
kind(
    "slow-disk-ring-full",
    "P2",
    "NPUKV_FAULTS=write:slow (a disk that stalls) with a small staging ring, "
    "saves staged faster than they are written",
    "put_async returns at once (well under the stall); batches that do not "
    "fit are dropped and counted, never waited for",
)
kind(
    "ring-larger-than-shm",
    "P4",
    "ring_size larger than /dev/shm",
    "prepare_async/put_async raise one ConfigError naming ring_size, the "
    "sizes and /dev/shm; no ring file is left; the keys stay savable",
)
kind(
    "ring-larger-than-shm-connector",
    "P2",
    "the same ring_size in a vLLM worker (WorkerSide.register)",
    "the worker turns off with one error line naming ring_size; its hooks "
    "never raise; a planned load is reported failed (vLLM recomputes)",
)
kind(
    "stale-ring-dead-pid",
    "P3",
    "a staging ring file in /dev/shm left by a dead pid",
    "removed when the next ring is created; a live pid's ring is kept",
)
kind(
    "foreign-ring-file",
    "P1",
    "a file in /dev/shm named like a ring but holding garbage",
    "left alone (not ours to judge); ring creation and saves work",
)
kind(
    "index-map-full",
    "P2",
    "index_map_size of 1 MiB: the LMDB index fills up",
    "saves fail and are counted, put_async never raises; earlier blocks read back",
)
kind(
    "tmp-dir-removed",
    "P2",
    "tmp/ removed under a running handle",
    "saves fail and are counted, the process goes on, reads still hit; a "
    "re-open saves again",
)

# -- reads ---------------------------------------------------------------------

kind(
    "read-eio",
    "P1",
    "NPUKV_FAULTS=read:eio (p=1 or 0.5) on the engine path (page cache dropped)",
    "affected blocks miss, misses counted, every hit has the stored bytes",
)
kind(
    "read-eio-transient",
    "P3",
    "one read:eio that then passes (a transient disk error)",
    "the blocks read again once the error is gone (an I/O error is not "
    "corruption: the chunk must not be quarantined)",
)
kind(
    "read-short",
    "P1",
    "NPUKV_FAULTS=read:short: reads return half their bytes",
    "affected blocks miss, never wrong",
)
kind(
    "read-eio-cached",
    "P1",
    "EIO on the cached-layer path (native pread_layers_xxh3 raises)",
    "the run's blocks miss, read_errors counted, never wrong",
)
kind(
    "chunk-deleted-after-lookup",
    "P1",
    "a chunk file unlinked between lookup (hit) and read",
    "its blocks miss, other chunks hit; its blocks can be saved again",
)
kind(
    "chunk-file-lost",
    "P2",
    "an indexed chunk file removed by something else than eviction",
    "after the first failed read the blocks are unpublished: lookups stop "
    "claiming them (each claim is a failed load and a recompute) and they are "
    "saved again",
)
kind(
    "chunk-truncated-mid-read",
    "P1",
    "a chunk cut short while its reads are in flight (read:slow)",
    "the rows past the end miss; no SIGBUS (pread, not mmap); never wrong",
)

# -- corrupt chunk files -------------------------------------------------------

kind(
    "bitflip-data",
    "P1",
    "one bit flipped in a chunk's data section",
    "that block misses (checksum), the chunk's other blocks and other chunks "
    "hit; never wrong",
)
kind(
    "bitflip-checksum-table",
    "P1",
    "one bit flipped in a chunk's checksum table",
    "that block misses, the rest hit; never wrong",
)
kind(
    "bitflip-header",
    "P1",
    "one bit flipped in a chunk's JSON header",
    "the chunk (or the key whose hex changed) misses, or nothing changes when "
    "the bit is padding; never wrong",
)
kind(
    "header-not-json",
    "P1",
    "a chunk's header replaced by bytes that are not JSON",
    "the chunk misses, other chunks hit",
)
kind(
    "header-length-past-eof",
    "P1",
    "a chunk's 8-byte header length larger than the file",
    "the chunk misses, nothing is allocated for the bogus length",
)
kind(
    "chunk-truncated",
    "P1",
    "a chunk file truncated at a random offset",
    "the blocks it no longer holds whole miss; never wrong",
)
kind(
    "chunk-zeroed",
    "P1",
    "a chunk file overwritten with zeros (a torn disk after power loss)",
    "the chunk misses, other chunks hit",
)
kind(
    "chunk-keys-differ-from-index",
    "P1",
    "two chunk files of one namespace swapped: each header lists other keys "
    "than the index",
    "their blocks miss (the key at the row is checked), never the other chunk's bytes",
)
kind(
    "foreign-chunk-in-place",
    "P1",
    "namespace A's chunk file moved over a chunk of namespace B",
    "B's blocks miss, never A's bytes",
)
kind(
    "foreign-chunk-on-rebuild",
    "P1",
    "namespace A's chunk copied into B's chunks/ under a new id, then the "
    "index rebuilt",
    "the rebuild does not adopt it into B; B never serves A's bytes",
)
kind(
    "two-models-one-dir",
    "P1",
    "two models (namespaces) in two processes on one directory, same tokens",
    "never a cross hit: each reads only its own bytes",
)

# -- the directory and the configuration ---------------------------------------

kind(
    "marker-garbled",
    "P4",
    "NPUKV_STORE marker that is not JSON",
    "BadMagic naming the marker and what was expected",
)
kind(
    "marker-other-version",
    "P4",
    "marker of another format version",
    "VersionMismatch naming the version found and the one expected",
)
kind(
    "namespace-json-other-spec",
    "P4",
    "namespace.json holding another spec",
    "NamespaceMismatch naming the file, what it holds and what was expected",
)
kind(
    "cache-dir-read-only",
    "P4",
    "cache_dir on a read-only mount (empty, or holding a store)",
    "KVStore raises OSError naming the path; the connector turns off with one "
    "error line naming cache_dir, the path and the errno text",
)
kind(
    "cache-dir-is-file",
    "P4",
    "cache_dir names a regular file",
    "ConfigError naming cache_dir and the path; the connector turns off with "
    "that one line",
)
kind(
    "cache-dir-missing-parent",
    "P4",
    "cache_dir whose parents do not exist",
    "documented: the parents are created and the store works",
)
kind(
    "cache-dir-parent-is-file",
    "P4",
    "a parent of cache_dir is a regular file",
    "OSError(ENOTDIR) naming the path; the connector turns off with one line",
)
kind(
    "cache-dir-on-tmpfs",
    "P4",
    "cache_dir on tmpfs (RAM), direct_io on",
    "documented: works (O_DIRECT falls back to buffered where refused)",
)
kind(
    "cache-dir-foreign-files",
    "P4",
    "cache_dir is a non-empty directory without a marker",
    "ConfigError naming the path and what it holds; nothing is deleted; the "
    "connector turns off with that one line",
)
kind(
    "config-garbled",
    "P4",
    "every config key given a garbled value, in extra config and as NPUKV_<KEY>",
    "one ConfigError naming the key, the value found and what was expected, "
    "before anything touches the disk",
)

# -- processes dying and files vanishing under them ----------------------------

kind(
    "index-deleted-while-running",
    "P3",
    "index/ removed while a process has the store open",
    "the running process keeps serving its own snapshot; another process "
    "rebuilds from the chunk files and loses nothing",
)
kind(
    "index-garbled-at-rest",
    "P3",
    "index data.mdb overwritten with garbage (whole or past its meta pages)",
    "the next open rebuilds it from the chunk files; nothing stored is lost",
)
kind(
    "index-garbled-while-running",
    "P1",
    "index data.mdb garbled under a running handle",
    "its calls return right answers or raise (the connector turns that into "
    "a miss), never wrong bytes, never a crash; a re-open rebuilds",
)
kind(
    "index-lock-removed",
    "P3",
    "index/lock.mdb removed while processes run; another process writes",
    "both processes go on; everything stored reads back, check() is clean",
)
kind(
    "tmp-file-of-dead-pid",
    "P3",
    "an in-flight tmp/ file of a dead pid (and one of a live pid)",
    "the dead pid's is removed at open, the live pid's is kept",
)
kind(
    "orphan-chunk",
    "P3",
    "an unindexed chunk file of a dead writer (and one of a live writer)",
    "the dead writer's is removed at open, never served; the live one's kept",
)
kind(
    "sigkill-writer-rename-commit",
    "P3",
    "a writer SIGKILLed between the rename into chunks/ and the index commit",
    "reopen: no orphan, no tmp, every returned put reads back",
)
kind(
    "sigkill-writer-in-index-txn",
    "P3",
    "a writer SIGKILLed inside the LMDB write transaction",
    "the write lock is recovered, the next put commits, nothing lost",
)
kind(
    "sigkill-async-writer",
    "P3",
    "a put_async writer SIGKILLed at random points of its background writes",
    "every put whose flush returned reads back; nothing torn is visible",
)
kind(
    "sigkill-reader-mid-read",
    "P3",
    "a reading process SIGKILLed mid-read",
    "its reader slot is freed; other processes read and write on; check() is clean",
)

# -- real vLLM (full form only) ------------------------------------------------

kind(
    "vllm-read-only-cache-dir",
    "P4",
    "vLLM started with cache_dir on a read-only mount",
    "one error line naming cache_dir, the path and 'Read-only file system'; "
    "no Traceback; vLLM serves with the baseline's tokens",
    full_only=True,
)
kind(
    "vllm-read-eio",
    "P1",
    "vLLM loading a stored prefix with NPUKV_FAULTS=read:eio",
    "the loads fail and are recomputed: the baseline's tokens",
    full_only=True,
)
kind(
    "vllm-sigkill-mid-save",
    "P3",
    "vLLM SIGKILLed while its writer is inside a chunk write (write:slow), "
    "then restarted on the same directory",
    "the restart gives the baseline's tokens; the directory is consistent",
    full_only=True,
)
kind(
    "vllm-ring-larger-than-shm",
    "P2",
    "vLLM started with a ring_size larger than /dev/shm",
    "the connector turns off with one error line naming ring_size; no "
    "Traceback; the baseline's tokens",
    full_only=True,
)


def register_all() -> dict[str, Kind]:
    """Import the test modules of tests/faults that register their own kinds
    (collection imports them all); the whole registry."""
    import contextlib
    import importlib
    from pathlib import Path

    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if "kind(" not in path.read_text():
            continue  # registers nothing (and may import vLLM: seconds)
        # (a module that skips itself outside pytest registers nothing more)
        with contextlib.suppress(BaseException):
            importlib.import_module(f"tests.faults.{path.stem}")
    return KINDS


def markdown_table() -> str:
    """docs/faults.md's table of kinds, from the whole registry."""
    register_all()
    rows = [
        "| kind | promise | fault injected | expected outcome |",
        "|---|---|---|---|",
    ]
    for name, entry in KINDS.items():
        where = " (full form only: real vLLM)" if entry.full_only else ""
        rows.append(f"| `{name}` | {entry.promise} | {entry.fault}{where} | "
                    f"{entry.expected} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":  # python -m tests.faults.kinds: the docs table
    from tests.faults import kinds  # the registry the test modules fill

    print(kinds.markdown_table())
