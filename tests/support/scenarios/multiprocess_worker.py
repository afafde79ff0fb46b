"""One spawned worker of the multi-process scenario (multiprocess.py): random
steps on prompts that share prefixes, each read checked byte for byte, and,
past its time, forced steps until the run has exercised MP_REQUIRED.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter
from typing import Any

from npukv_store import KVStore, NamespaceSpec, StoreConfig
from tests.support.blocks import block_tensors, empty_blocks, verify_read
from tests.support.scenarios.oracles import SPEC, do_put

#: Prompts are a shared prefix (so workers race on the same keys) cut at a
#: random block, plus a short suffix over a tiny vocabulary (so suffixes collide
#: between workers too).
NUM_PREFIXES = 12
PREFIX_BLOCKS = 6
SUFFIX_BLOCKS = 3
SUFFIX_VOCAB = 2
MP_MAX_BLOCKS = PREFIX_BLOCKS + SUFFIX_BLOCKS
#: What every run must have exercised (summed tallies and counters > 0). A run
#: that has not when its ``seconds`` are up goes on, forcing each of them (see
#: :func:`_forced_step`), for up to ``overtime_s``; the parent's own
#: requirement (``until``) is the last flag.
MP_REQUIRED = ("put_stored", "put_skipped", "read_hits", "counter.evicted_chunks")


def _prefixes(spec: NamespaceSpec, seed: int) -> list[list[int]]:
    rng = random.Random(f"prefixes:{seed}")
    tokens = PREFIX_BLOCKS * spec.block_size
    return [
        [rng.randrange(1000, 50000) for _ in range(tokens)] for _ in range(NUM_PREFIXES)
    ]


def _prompt(
    spec: NamespaceSpec, prefixes: list[list[int]], rng: random.Random
) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randint(1, PREFIX_BLOCKS) * spec.block_size]
    suffix = [
        rng.randrange(SUFFIX_VOCAB)
        for _ in range(rng.randint(0, SUFFIX_BLOCKS) * spec.block_size)
    ]
    return prefix + suffix


def run_worker(
    wid: int,
    config_kwargs: dict[str, Any],
    seed: int,
    seconds: float,
    fault_after_s: float | None,
    barrier,
    results,
    mode: str = "sync",
    exercised=None,
    overtime_s: float = 0.0,
) -> None:
    """Entry point of one spawned worker: reports ("ok"|"error", wid, payload)."""
    try:
        report = _worker_loop(
            wid, config_kwargs, seed, seconds, fault_after_s, barrier, mode,
            exercised, overtime_s,
        )  # fmt: skip
        results.put(("ok", wid, report))
    except BaseException:
        results.put(("error", wid, traceback.format_exc()))
        raise


def _worker_loop(
    wid: int,
    config_kwargs: dict[str, Any],
    seed: int,
    seconds: float,
    fault_after_s: float | None,
    barrier,
    mode: str = "sync",
    exercised=None,
    overtime_s: float = 0.0,
) -> dict[str, Any]:
    """Random steps for ``seconds``; then, while some flag of ``exercised``
    (one per MP_REQUIRED name, set by any worker, then the parent's) is
    unset, for up to ``overtime_s`` more, random steps each followed by a
    forced one."""
    spec = SPEC
    # Odd workers trust the disk (verify="never"): a wrong row they get is not
    # masked as a checksum miss, so the byte comparison below sees it.
    verify = "never" if wid % 2 else "always"
    store = KVStore(StoreConfig(**config_kwargs, verify=verify), spec)
    prefixes = _prefixes(spec, seed)
    rng = random.Random(f"worker:{seed}:{wid}")
    tally: Counter[str] = Counter()
    max_total = 0
    problems: list[str] = []
    barrier.wait(timeout=120)
    start = time.monotonic()
    fresh = 0
    while not problems:
        now = time.monotonic()
        overtime = now >= start + seconds
        if overtime and (
            exercised is None or all(exercised) or now >= start + seconds + overtime_s
        ):
            break
        if (
            fault_after_s is not None
            and wid == 0
            and time.monotonic() > start + fault_after_s
        ):
            raise RuntimeError("injected worker fault (harness self-test)")
        _random_step(store, spec, prefixes, rng, mode, tally, problems)
        if overtime and exercised is not None and not all(exercised[:-1]):
            _forced_step(store, spec, wid, fresh, rng, mode, tally, problems)
            fresh += 1
        if exercised is not None:
            _note_exercised(exercised, tally, store.counters.snapshot())
        max_total = max(max_total, store.stats().total_bytes)
    counters = store.stats().counters
    store.close()
    return {
        "tally": dict(tally),
        "counters": counters,
        "max_total": max_total,
        "problems": problems[:20],
        "verify": verify,
    }


def _note_exercised(exercised, tally: Counter[str], counters: dict[str, int]) -> None:
    """Set the flag of each MP_REQUIRED name this worker has exercised."""
    for index, name in enumerate(MP_REQUIRED):
        if name.startswith("counter."):
            value = counters.get(name.removeprefix("counter."), 0)
        else:
            value = tally[name]
        if value > 0:
            exercised[index] = 1


def _forced_step(
    store: KVStore,
    spec: NamespaceSpec,
    wid: int,
    fresh: int,
    rng: random.Random,
    mode: str,
    tally: Counter[str],
    problems: list[str],
) -> None:
    """A step that exercises what random steps may miss: put a prompt no one
    has put (MP_MAX_BLOCKS new blocks, a largest chunk: a few of these exceed
    any capacity, so commits must evict), read it back (hits), and put it
    again (skips: its blocks are stored)."""
    count = MP_MAX_BLOCKS * spec.block_size
    tokens = [rng.randrange(10**6, 10**9) for _ in range(count)]
    keys = store.keys_for([-1 - wid, fresh, *tokens])  # never a random step's prompt
    tally["lookups"] += 1
    store.lookup(keys)
    tensors = block_tensors(spec, keys)
    result = do_put(store, keys, tensors, mode)
    tally["put_stored"] += result.stored
    tally["put_skipped"] += result.skipped
    tally["put_rejected"] += result.rejected
    out = empty_blocks(spec, len(keys), None)
    ok = store.read(keys, out)
    problems += verify_read(spec, keys, out, ok)
    tally["read_hits"] += sum(ok)
    tally["read_misses"] += len(ok) - sum(ok)
    again = do_put(store, keys, tensors, mode)
    tally["put_stored"] += again.stored
    tally["put_skipped"] += again.skipped
    tally["put_rejected"] += again.rejected


def _random_step(
    store: KVStore,
    spec: NamespaceSpec,
    prefixes: list[list[int]],
    rng: random.Random,
    mode: str,
    tally: Counter[str],
    problems: list[str],
) -> None:
    """One random step: look a prompt up, read some of it, put what is missing."""
    keys = store.keys_for(_prompt(spec, prefixes, rng))
    hit = store.lookup(keys)
    tally["lookups"] += 1
    pick = rng.random()  # not `mode`: that is the put mode, used below
    if pick < 0.5:  # the connector's path: read what lookup promised
        read_keys, layers = keys[:hit], None
    elif pick < 0.75:  # also ask for blocks lookup did not report
        read_keys, layers = keys, None
    else:  # one layer only, as layerwise loading does
        read_keys, layers = keys, [rng.randrange(len(spec.layers))]
    if read_keys:
        out = empty_blocks(spec, len(read_keys), layers)
        ok = store.read(read_keys, out)
        problems += verify_read(spec, read_keys, out, ok)
        tally["read_hits"] += sum(ok)
        tally["read_misses"] += len(ok) - sum(ok)
        if pick < 0.5:  # allowed (evicted in between), but worth counting
            tally["lookup_hit_read_miss"] += len(ok) - sum(ok)
    if hit < len(keys):
        # Mostly the missing tail; sometimes the whole prompt, to take the
        # skip path and to race whole chunks against other workers.
        put_keys = keys if rng.random() < 0.25 else keys[hit:]
        absent = sum(loc is None for loc in store.index.locate(put_keys))
        result = do_put(store, put_keys, block_tensors(spec, put_keys), mode)
        tally["put_stored"] += result.stored
        tally["put_skipped"] += result.skipped
        tally["put_rejected"] += result.rejected
        # Rows absent just before put() that it neither stored nor rejected
        # were committed by another worker in between: a lost race (net of
        # rows another worker's eviction freed in between).
        tally["lost_races"] += absent - result.stored - result.rejected
