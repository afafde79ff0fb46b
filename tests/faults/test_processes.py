"""Processes dying, and shared files vanishing or garbled under running ones:
the index, its lock file, tmp/ leftovers, orphan chunks, writers and readers
killed with SIGKILL. Every other process keeps working or misses; a re-open
recovers; nothing durable is lost, nothing torn is visible.

Children run in fresh interpreters (``faults.run_child``) and print one JSON
line; a child that dies, or prints a traceback, counts as a process crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench.harness.processes import reaping
from npukv_store import KVStore, StoreConfig
from tests.support import faults
from tests.support.blocks import block_tensors
from tests.support.faults import BIG, BLOCKS, SMALL, config, fill, keys_for
from tests.support.scenarios import crash, crash_plan

#: A child's preamble: the store, the specs and the fault suite's helpers.
PRELUDE = """
import json, os, sys
from npukv_store import KVStore
from tests.support import faults
from tests.support.blocks import block_tensors, empty_blocks, verify_read
from tests.support.faults import BIG, SMALL, config, keys_for
def report(**values):
    print(json.dumps(values), flush=True)
"""


def _child(fault, name: str, body: str, **values) -> dict:
    """Run ``body`` (with ``values`` bound as globals) in a child; its report."""
    assign = "".join(f"{k} = {v!r}\n" for k, v in values.items())
    code = PRELUDE + assign + textwrap.dedent(body)
    done = faults.run_child(code)
    fault.process(name, done.returncode, done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


#: a child that reads hex ``keys`` from ``root`` and reports hits and wrong rows
READER = """
cfg = config(root)
want = [bytes.fromhex(k) for k in keys]
with KVStore(cfg, BIG) as store:
    out = empty_blocks(BIG, len(want))
    ok = store.read(want, out)
    wrong = verify_read(BIG, want, out, ok)
    extra = None
    if put_tag:
        new = keys_for(put_tag, faults.BLOCKS)
        store.put(new, block_tensors(BIG, new))
        extra = [k.hex() for k in new if store.lookup([k])]
report(ok=ok, wrong=len(wrong), put=extra)
"""


def _account_child(fault, result: dict, durable_count: int, where: str) -> None:
    """A READER child's report: wrong rows; misses among the first
    ``durable_count`` keys are lost blocks."""
    if not result:
        return
    fault.wrong(result["wrong"], f"{where}: the child read wrong bytes")
    missed = result["ok"][:durable_count].count(False)
    fault.lost(missed, f"{where}: the child missed {missed} durable blocks")


# -- the index --------------------------------------------------------------------


@pytest.mark.fault("index-deleted-while-running")
def test_index_deleted_while_a_process_runs(fault, tmp_path):
    for trial in fault.trials(1, 3):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            durable = [k for _, ks in fill(store, f"idx{trial}", 2) for k in ks]
            shutil.rmtree(os.path.join(cfg.cache_dir, "index"))
            fault.durable(store, durable, "the running process after the rm:")
            after = keys_for(f"idx{trial}:after", BLOCKS)  # may go unseen: allowed
            store.put(after, block_tensors(BIG, after))
            result = _child(
                fault, "reader", READER, root=cfg.cache_dir,
                keys=_hexes(durable + after), put_tag=f"idx{trial}:child",
            )  # fmt: skip
            _account_child(fault, result, len(durable), f"trial {trial}")
            fault.read_back(store, durable + after)  # never wrong, hit or miss
        with KVStore(cfg, BIG) as store:
            fault.durable(store, durable, f"trial {trial} reopened:")
            if result.get("put"):
                fault.durable(store, [bytes.fromhex(k) for k in result["put"]])
            assert store.check() == []


def _garble(path: str, rng: random.Random) -> None:
    size = os.path.getsize(path)
    start = rng.choice([0, 8192])  # the meta pages too, or only the data pages
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(rng.randbytes(size - start))


@pytest.mark.fault("index-garbled-at-rest")
def test_garbled_index_is_rebuilt(fault, tmp_path):
    seed = random.randrange(2**32)
    for trial in fault.trials(2, 6):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            durable = [k for _, ks in fill(store, f"gar{trial}", 3) for k in ks]
        rng = random.Random(f"{seed}:{trial}")
        _garble(os.path.join(cfg.cache_dir, "index", "data.mdb"), rng)
        with KVStore(cfg, BIG) as store:
            fault.durable(store, durable, f"seed {seed} trial {trial}:")
            assert store.check() == []


GARBLED_LIVE = """
import random
cfg = config(root)
want = [bytes.fromhex(k) for k in keys]
raised, wrong, hits = [], 0, 0
with KVStore(cfg, BIG) as store:
    store.read(want, empty_blocks(BIG, len(want)))  # warm: a live handle
    path = os.path.join(root, "index", "data.mdb")
    size = os.path.getsize(path)
    rng = random.Random(seed)
    with open(path, "r+b") as handle:
        handle.seek(start)
        handle.write(rng.randbytes(size - start))
    for call in ("lookup", "read", "put", "lookup", "read"):
        try:
            if call == "lookup":
                store.lookup(want)
            elif call == "read":
                out = empty_blocks(BIG, len(want))
                ok = store.read(want, out)
                wrong += len(verify_read(BIG, want, out, ok))
                hits += sum(ok)
            else:
                new = keys_for(f"live{seed}", faults.BLOCKS)
                store.put(new, block_tensors(BIG, new))
        except Exception as exc:
            raised.append(f"{call}: {type(exc).__name__}")
    try:
        store.close()
    except Exception as exc:
        raised.append(f"close: {type(exc).__name__}")
report(raised=raised, wrong=wrong, hits=hits)
"""


@pytest.mark.fault("index-garbled-while-running")
def test_index_garbled_under_a_running_handle(fault, tmp_path):
    seed = random.randrange(2**32)
    for trial in fault.trials(2, 6):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            durable = [k for _, ks in fill(store, f"live{trial}", 2) for k in ks]
        result = _child(
            fault, "garbled", GARBLED_LIVE, root=cfg.cache_dir,
            keys=_hexes(durable), seed=seed + trial, start=[0, 8192][trial % 2],
        )  # fmt: skip
        if result:
            fault.wrong(result["wrong"], f"seed {seed} trial {trial}: {result}")
        with KVStore(cfg, BIG) as store:  # a re-open rebuilds
            fault.durable(store, durable, f"seed {seed} trial {trial} reopened:")
            assert store.check() == []


LOCK_WRITER = """
cfg = config(root)
with KVStore(cfg, BIG) as store:
    stored = []
    for b in range(batches):
        new = keys_for(f"{tag}:{b}", faults.BLOCKS)
        if store.put(new, block_tensors(BIG, new)).stored == len(new):
            stored += [k.hex() for k in new]
report(stored=stored)
"""


@pytest.mark.fault("index-lock-removed")
def test_index_lock_file_removed_while_processes_run(fault, tmp_path):
    for trial in fault.trials(1, 4):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            durable = [k for _, ks in fill(store, f"lock{trial}", 2) for k in ks]
            os.unlink(os.path.join(cfg.cache_dir, "index", "lock.mdb"))
            # the other process writes while this one does (separate lock files)
            proc = faults.start_child(
                PRELUDE + f"root = {cfg.cache_dir!r}\ntag = 'lock{trial}c'\n"
                f"batches = 6\n" + textwrap.dedent(LOCK_WRITER)
            )
            with reaping(proc):
                mine = []
                for b in range(6):
                    new = keys_for(f"lock{trial}p:{b}", BLOCKS)
                    if store.put(new, block_tensors(BIG, new)).stored:
                        mine += new
                out, _ = proc.communicate(timeout=120)
            fault.process("lock writer", proc.returncode, out)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            theirs = [bytes.fromhex(k) for k in json.loads(lines[-1])["stored"]]
            fault.durable(store, durable + mine, f"trial {trial} (this process):")
        with KVStore(cfg, BIG) as store:
            fault.durable(store, durable + mine + theirs, f"trial {trial} reopened:")
            assert store.check(verify_data=True) == []


# -- leftovers of dead processes --------------------------------------------------


def _dead_pid() -> int:
    return int(faults.run_child("import os; print(os.getpid())").stdout)


def _died_with_store_open(cfg) -> int:
    """A process that opened the store and died without closing it: what a
    killed writer is, and what makes the next open scan (decision 0059)."""
    code = (
        "import os; from npukv_store import KVStore, StoreConfig; "
        "from tests.support.faults import SMALL; "
        f"KVStore(StoreConfig(cache_dir={cfg.cache_dir!r}), SMALL); "
        "print(os.getpid(), flush=True); os._exit(0)"
    )
    return int(faults.run_child(code).stdout)


@pytest.mark.fault("tmp-file-of-dead-pid")
def test_tmp_files_of_dead_and_live_pids(fault, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for trial in fault.trials(2, 4):
            cfg = config(tmp_path / f"t{trial}")
            keys = keys_for(f"tmpfile{trial}", 4)
            with KVStore(cfg, SMALL) as store:
                store.put(keys, block_tensors(SMALL, keys))
            tmp = os.path.join(cfg.cache_dir, "tmp")
            dead = os.path.join(tmp, f"{_died_with_store_open(cfg)}-{trial:016x}.tmp")
            live = os.path.join(tmp, f"{sleeper.pid}-{trial:016x}.tmp")
            for path in (dead, live):
                with open(path, "wb") as handle:
                    handle.write(os.urandom(4096 * (trial + 1)))
            with KVStore(cfg, SMALL) as store:  # recovery at open
                fault.durable(store, keys)
            assert not os.path.exists(dead), "a dead pid's tmp file survived"
            assert os.path.exists(live), "a live writer's tmp file was removed"
    finally:
        sleeper.kill()
        sleeper.wait()


ORPHAN_WRITER = """
cfg = config(root)
store = KVStore(cfg, BIG)
path = faults.put_chunk(store, keys_for(tag, faults.BLOCKS))
report(path=path)
os._exit(0)  # with the store open: the next open scans (decision 0059)
"""


@pytest.mark.fault("orphan-chunk")
def test_orphan_chunks_of_dead_and_live_writers(fault, tmp_path):
    for trial in fault.trials(1, 3):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            live_path, live_keys = fill(store, f"orph{trial}:live", 1)[0]
        result = _child(fault, "orphan writer", ORPHAN_WRITER, root=cfg.cache_dir,
                        tag=f"orph{trial}:dead")  # fmt: skip
        dead_keys = keys_for(f"orph{trial}:dead", BLOCKS)
        chunks = os.path.dirname(live_path)
        stray_dead = os.path.join(
            chunks, f"{random.randrange(1, 2**63):016x}.safetensors"
        )
        stray_live = os.path.join(
            chunks, f"{random.randrange(1, 2**63):016x}.safetensors"
        )
        shutil.copyfile(result["path"], stray_dead)  # creator: the dead child
        shutil.copyfile(live_path, stray_live)  # creator: this process (alive)
        with KVStore(cfg, BIG) as store:  # recovery at open
            fault.durable(store, live_keys + dead_keys, f"trial {trial}:")
        assert not os.path.exists(stray_dead), "a dead writer's orphan survived"
        assert os.path.exists(stray_live), "a live writer's orphan was removed"
        os.unlink(stray_live)


# -- SIGKILL ----------------------------------------------------------------------


def _crash_trials(fault, tmp_path, plan, mode: str) -> None:
    """``crash.run_crash_trials`` (kill, reopen, check every invariant),
    then this suite's own count over its logs: every put whose return was
    logged must read back."""
    seed = random.randrange(2**32)
    cache, logs = str(tmp_path / "cache"), str(tmp_path / "logs")
    try:
        crash.run_crash_trials(cache, logs, plan, seed=seed, mode=mode)
    finally:
        returned, in_flight = [], []
        for number in range(len(plan)):
            trial_seed = seed * 100_003 + number
            log = crash.read_log(os.path.join(logs, f"trial-{number}.log"))
            for batch, *_ in log:
                returned += crash_plan.crash_batch_keys(trial_seed, batch)
            in_flight += crash_plan.crash_batch_keys(trial_seed, len(log))
        if os.path.isdir(cache):
            cfg = faults.fresh_config(StoreConfig(cache_dir=cache, capacity=1 << 30))
            with KVStore(cfg, SMALL) as store:
                fault.durable(store, returned, f"seed {seed}:")
                fault.read_back(store, in_flight)  # hit or miss, never wrong


@pytest.mark.fault("sigkill-writer-rename-commit")
def test_sigkill_between_rename_and_commit(fault, tmp_path):
    repeats = 2 if fault.full else 1
    plan = crash_plan.targeted_plan([crash_plan.PHASE_RENAMED], repeats=repeats * 2)
    list(fault.trials(len(plan), len(plan)))
    _crash_trials(fault, tmp_path, plan, "sync")


@pytest.mark.fault("sigkill-writer-in-index-txn")
def test_sigkill_inside_the_index_transaction(fault, tmp_path):
    repeats = 2 if fault.full else 1
    plan = crash_plan.targeted_plan([crash_plan.PHASE_IN_TXN], repeats=repeats * 2)
    list(fault.trials(len(plan), len(plan)))
    _crash_trials(fault, tmp_path, plan, "sync")


@pytest.mark.fault("sigkill-async-writer")
def test_sigkill_of_an_async_writer(fault, tmp_path):
    count = 12 if fault.full else 2
    plan = crash_plan.random_plan(count, random.Random(), max_delay_s=0.15)
    list(fault.trials(count, count))
    _crash_trials(fault, tmp_path, plan, "async")


SLOW_READER = """
import time
cfg = config(root)
want = [bytes.fromhex(k) for k in keys]
with KVStore(cfg, BIG) as store:
    report(ready=True)
    while True:
        faults.drop_page_cache(faults.chunk_paths(root))
        store.lookup(want)
        store.read(want, empty_blocks(BIG, len(want)))
"""


@pytest.mark.fault("sigkill-reader-mid-read")
def test_sigkill_of_a_reader_mid_read(fault, tmp_path, monkeypatch):
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        durable = [k for _, ks in fill(store, "reader", 3) for k in ks]
    for trial in fault.trials(2, 6):
        monkeypatch.setenv("NPUKV_FAULTS", "read:slow:ms=20")  # inside a read
        proc = faults.start_child(
            PRELUDE + f"root = {cfg.cache_dir!r}\nkeys = {_hexes(durable)!r}\n"
            + textwrap.dedent(SLOW_READER), keep_faults=True,
        )  # fmt: skip
        monkeypatch.delenv("NPUKV_FAULTS")
        with reaping(proc):
            assert proc.stdout is not None
            ready = proc.stdout.readline()
            assert "ready" in ready, ready + proc.communicate(timeout=30)[0]
            time.sleep(random.uniform(0.05, 0.4))
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        fault.process("reader", proc.returncode, out, expect_rc=-signal.SIGKILL)
        with KVStore(cfg, BIG) as store:  # reader slots of the dead are freed
            fault.durable(store, durable, f"trial {trial}:")
            new = keys_for(f"reader:after{trial}", BLOCKS)
            store.put(new, block_tensors(BIG, new))
            durable += new
            assert store.check() == []


# -- two models on one directory --------------------------------------------------

MODEL = """
import dataclasses
spec = dataclasses.replace(BIG, model=model)
cfg = config(root)
wrong = hits = 0
with KVStore(cfg, spec) as store:
    for round in range(rounds):
        for p in range(prompts):
            keys = store.keys_for(list(range(p * 7, p * 7 + 32)))
            out = empty_blocks(spec, len(keys))
            ok = store.read(keys, out)
            wrong += len(verify_read(spec, keys, out, ok))
            hits += sum(ok)
            store.put(keys, block_tensors(spec, keys))
report(wrong=wrong, hits=hits)
"""


@pytest.mark.fault("two-models-one-dir")
def test_two_models_sharing_a_directory_never_cross_hit(fault, tmp_path):
    for trial in fault.trials(1, 3):
        root = str(tmp_path / f"t{trial}")
        rounds = 3 if fault.full else 2
        procs = [
            faults.start_child(
                PRELUDE + f"root = {root!r}\nmodel = {m!r}\nrounds = {rounds}\n"
                "prompts = 4\n" + textwrap.dedent(MODEL)
            )
            for m in ("npukv-test/model-a", "npukv-test/model-b")
        ]
        reports = []
        with reaping(*procs):
            for proc in procs:
                out, _ = proc.communicate(timeout=120)
                fault.process("model", proc.returncode, out)
                lines = [line for line in out.splitlines() if line.startswith("{")]
                reports.append(json.loads(lines[-1]) if lines else {})
        for report in reports:
            fault.wrong(report.get("wrong", 0), f"trial {trial}: {report}")
        # same tokens, other model: no key of A is a hit for B
        spec_a = dataclasses.replace(BIG, model="npukv-test/model-a")
        spec_b = dataclasses.replace(BIG, model="npukv-test/model-b")
        with KVStore(config(root), spec_a) as a:
            keys_a = a.keys_for(list(range(32)))
            assert a.lookup(keys_a) == len(keys_a)
        with KVStore(config(root), spec_b) as b:
            keys_b = b.keys_for(list(range(32)))
            assert not set(keys_a) & set(keys_b)
            assert not any(fault.read_back(b, keys_a)), "B served A's blocks"
            fault.durable(b, keys_b)
