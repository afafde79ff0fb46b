"""The maintenance job killed with SIGKILL in each of its windows: compaction
(tmp written, renamed but not committed, inside the replace transaction,
committed but the old files not unlinked), eviction (inside its transaction,
before its unlinks), quarantine (file moved, rows not yet dropped) and the
garbage step (between two unlinks), and ``--rebuild-index`` between two of its
batches.

A child runs ``maintenance.run`` with one function wrapped to SIGKILL the
child exactly there. Afterwards, from fresh handles: every block stored before
(and not evicted or corrupt by design) reads back with its bytes, no read is
wrong, the next maintenance run takes the lock and leaves a directory that
``check(verify_data=True)`` passes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from npukv_store import KVStore
from npukv_store.maintenance import Options, run
from tests.faults.kinds import kind
from tests.support import faults
from tests.support.faults import BIG, config, fill

#: where the child dies: (module path, attribute, wrapper). The wrapper kills on
#: its ``after``-th call, before (``when="before"``) or after the real call.
WINDOWS = {
    "compact-kill-tmp-written": ("os", "rename", "before", 1),
    "compact-kill-renamed-not-committed": (
        "npukv_store.store.index:Index", "replace_chunks", "before", 1,
    ),
    "compact-kill-inside-replace-txn": (
        "npukv_store.store.index:Index", "_unpublish_in", "before", 1,
    ),
    "compact-kill-before-old-unlinked": (
        "npukv_store.store.publish", "unlink_quietly", "before", 1,
    ),
    "evict-kill-inside-txn": (
        "npukv_store.store.index:Index", "_unpublish_in", "before", 2,
    ),
    "evict-kill-before-unlinks": (
        "npukv_store.store.publish", "unlink_quietly", "before", 1,
    ),
    "quarantine-kill-moved-not-dropped": (
        "npukv_store.store.index:Index", "remove_chunks", "before", 1,
    ),
    "gc-kill-between-unlinks": ("os", "unlink", "after", 1),
    # batches of one chunk (the child sets REBUILD_BATCH = 1): dies after the
    # first batch committed, before the second
    "rebuild-kill-between-batches": (
        "npukv_store.store.index:Index", "commit_rebuilt", "before", 2,
    ),
}  # fmt: skip

for _name, _promise_fault in {
    "compact-kill-tmp-written": "compaction's new chunk written to tmp/, not renamed",
    "compact-kill-renamed-not-committed": "compaction's new chunk renamed into "
    "chunks/, its replace not committed",
    "compact-kill-inside-replace-txn": "inside compaction's replace transaction",
    "compact-kill-before-old-unlinked": "replace committed, old files not unlinked",
    "evict-kill-inside-txn": "inside the eviction transaction of --target",
    "evict-kill-before-unlinks": "eviction committed, victims not unlinked",
    "quarantine-kill-moved-not-dropped": "--verify moved a corrupt chunk to "
    "quarantine/, its rows not yet dropped",
    "gc-kill-between-unlinks": "the garbage step between two orphan unlinks",
    "rebuild-kill-between-batches": "--rebuild-index between two synced batches "
    "of its aside index (the next open takes the rebuild over)",
}.items():
    kind(
        _name,
        "P3",
        f"SIGKILL of the maintenance job: {_promise_fault}",
        "no wrong read; every block stored before reads back (evicted or corrupt "
        "ones excepted); the next run takes the lock and check() is clean",
    )

CHILD = """
import os, signal, importlib
from npukv_store.maintenance import Options, run
from npukv_store.store import recovery
recovery.REBUILD_BATCH = 1  # several batches out of a few chunks
module_path, attr, when, after = WINDOW
module_name, _, cls = module_path.partition(":")
owner = importlib.import_module(module_name)
if cls:
    owner = getattr(owner, cls)
real = getattr(owner, attr)
calls = [0]
def wrapped(*args, **kwargs):
    calls[0] += 1
    hit = calls[0] == after
    if hit and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = real(*args, **kwargs)
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
if attr in ("rename", "unlink"):
    def wrapped_os(*args, **kwargs):  # count only the calls on our files
        where = kwargs.get("src_dir_fd", kwargs.get("dir_fd"))  # *at() calls
        path = str(args[0])
        if where is not None:
            path = os.path.join(os.readlink(f"/proc/self/fd/{where}"), path)
        if MATCH not in path:
            return real(*args, **kwargs)
        return wrapped(*args, **kwargs)
    setattr(owner, attr, wrapped_os)
else:
    setattr(owner, attr, wrapped)
run(Options(cache_dir=ROOT, **OPTIONS))
print("survived", flush=True)
"""


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def _setup(root: str, name: str, trial: int) -> tuple[list[bytes], list[bytes]]:
    """Blocks in small chunks (compaction merges them); returns (durable keys,
    keys a window may destroy by design: evicted or corrupt)."""
    with KVStore(config(root), BIG) as store:
        chunks = fill(store, f"{name}:{trial}", chunks=4)
    keys = [k for _, chunk_keys in chunks for k in chunk_keys]
    doomed: list[bytes] = []
    if name.startswith("evict"):
        doomed = keys  # any may be evicted: only wrong reads count
    if name.startswith("quarantine"):
        path, doomed = chunks[0]
        faults.flip_bit(path, faults.data_start(path) + 5, 3)
    if name.startswith("gc"):
        dead = _dead_pid()
        for number in range(3):  # in-flight files of a dead writer
            with open(f"{root}/tmp/{dead}-{number:016x}.tmp", "wb") as handle:
                handle.write(b"x" * 4096)
    return [k for k in keys if k not in doomed], doomed


def _options(name: str) -> dict[str, object]:
    if name.startswith("evict"):
        return {"target": 0.0, "grace_s": 0.0, "capacity": 1 << 30}
    if name.startswith("quarantine"):
        return {"verify": True}
    if name.startswith("gc"):
        return {"gc_only": True}
    if name.startswith("rebuild"):
        return {"rebuild_index": True, "gc_only": True}
    return {"min_live": 1.0}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.fault(n), id=n) for n in sorted(WINDOWS)]
)
def test_maintenance_killed_in_each_window(tmp_path, fault, name):
    for trial in fault.trials(quick=1, full=3):
        root = str(tmp_path / f"t{trial}")
        durable, doomed = _setup(root, name, trial)
        match = f"{root}/tmp/" if name == "compact-kill-tmp-written" else root
        code = (
            f"WINDOW = {WINDOWS[name]!r}\nROOT = {root!r}\nMATCH = {match!r}\n"
            f"OPTIONS = {_options(name)!r}\n" + textwrap.dedent(CHILD)
        )
        done = faults.run_child(code)
        fault.process(name, done.returncode, done.stdout + done.stderr,
                      expect_rc=-signal.SIGKILL)  # fmt: skip
        with KVStore(config(root), BIG) as store:
            fault.durable(store, durable, f"{name} trial {trial}")
            fault.read_back(store, doomed)  # may miss; must not be wrong
        summary = run(Options(cache_dir=root, ring_dir=str(tmp_path)))
        with KVStore(config(root), BIG) as store:
            problems = store.check(verify_data=True)
            fault.durable(store, durable, f"{name} trial {trial}, after a rerun")
        assert problems == [], f"{name}: check after the rerun: {problems}"
        assert summary.chunks_after >= 0  # the rerun took the lock and finished
