"""Scenario 2's plan: where a SIGKILL lands in a writer's put.

Crash trial classes (``CrashTrial``), and what each one covers:

* plain (``hooks=False, target=None``): the child puts 1-4 block chunks in a loop
  with ``fsync="chunk"``; SIGKILL lands after a uniform random delay, mostly in
  the tmp write and fsyncs, sometimes inside the LMDB commit or between puts.
* widened (``hooks=True, target=None``): as plain, but the child wraps
  ``os.fsync``, ``os.rename`` and ``Index.commit_chunk`` / ``_touch_in`` /
  ``_unpublish_in`` with random 0-3 ms naps, so random kills land more often
  between rename and commit, inside the write transaction, and between commit
  and the put's return.
* targeted (``hooks=True, target=PHASE_*``): the child publishes its publish
  phase in shared memory and stops when it enters the target phase; the parent
  kills it there, so every window is hit for certain: tmp written (before
  rename), renamed but not committed, inside the LMDB write transaction (holding
  the write lock), committed but not returned, and, with ``evict=True``,
  evicting inside the transaction and evicted but the victims' files not yet
  unlinked. The parent asserts the leftover each window must leave: a tmp file
  of the dead pid, an unindexed chunk file, or the in-flight put's keys readable.
"""

from __future__ import annotations

import hashlib
import os
import random
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

# Publish phases the hooked child announces in shared memory (see install_hooks).
PHASE_IDLE = 0
PHASE_TMP_WRITTEN = 1  # chunk bytes in tmp/, fsync about to run, not renamed
PHASE_RENAMED = 2  # chunk file in <ns>/chunks/, not yet committed
PHASE_IN_TXN = 3  # inside the LMDB write transaction, holding the write lock
PHASE_EVICTING = 4  # inside the transaction, unpublishing a victim
PHASE_COMMITTED = 5  # committed without evicting, put() not returned
PHASE_EVICTED = 6  # committed with victims, their files not unlinked yet
PHASE_NAMES = {
    PHASE_IDLE: "idle",
    PHASE_TMP_WRITTEN: "tmp-written",
    PHASE_RENAMED: "renamed",
    PHASE_IN_TXN: "in-txn",
    PHASE_EVICTING: "evicting",
    PHASE_COMMITTED: "committed",
    PHASE_EVICTED: "evicted",
}
CRASH_MAX_BLOCKS = 4
#: The child waits this long in the targeted phase: the parent kills it there
#: long before, so where the kill lands does not depend on scheduling.
_TARGET_NAP_S = 60.0


@dataclass(frozen=True)
class CrashTrial:
    """One kill: ``hooks`` widens the publish windows in the child; ``target``
    kills on entering that phase, else after ``delay_s`` from ready."""

    hooks: bool
    target: int | None = None
    delay_s: float = 0.0
    skip_puts: int = 0  # targeted: puts that pass the target phase unharmed

    def describe(self) -> str:
        if self.target is not None:
            return f"targeted:{PHASE_NAMES[self.target]}@put{self.skip_puts}"
        return f"{'widened' if self.hooks else 'plain'}:{self.delay_s * 1e3:.0f}ms"


def random_plan(
    trials: int, rng: random.Random, max_delay_s: float = 0.15
) -> list[CrashTrial]:
    """Random-delay kills, alternating plain and widened children."""
    return [
        CrashTrial(hooks=bool(i % 2), delay_s=rng.uniform(0, max_delay_s))
        for i in range(trials)
    ]


def targeted_plan(phases: Sequence[int], repeats: int = 1) -> list[CrashTrial]:
    """One kill per phase, ``repeats`` times; the kill hits put 0, 1, 2 or 3 of
    the child, so the store holds earlier puts of the same trial."""
    return [
        CrashTrial(hooks=True, target=p, skip_puts=(r + i) % 4)
        for r in range(repeats)
        for i, p in enumerate(phases)
    ]


#: The windows of a put without eviction, and those of an evicting put.
PUBLISH_PHASES = (PHASE_TMP_WRITTEN, PHASE_RENAMED, PHASE_IN_TXN, PHASE_COMMITTED)
EVICT_PHASES = (PHASE_IN_TXN, PHASE_EVICTING, PHASE_EVICTED)


def mixed_plan(
    trials: int,
    rng: random.Random,
    phases: Sequence[int],
    targeted_share: float = 1 / 3,
    max_delay_s: float = 0.15,
) -> list[CrashTrial]:
    """``trials`` kills in random order: a share targeted at ``phases`` (round
    robin), the rest at random delays (plain and widened alternating)."""
    targeted = round(trials * targeted_share)
    repeats = -(-targeted // len(phases)) if targeted else 0
    plan = targeted_plan(phases, repeats)[:targeted]
    plan += random_plan(trials - targeted, rng, max_delay_s)
    rng.shuffle(plan)
    return plan


def crash_batch_keys(trial_seed: int, batch: int) -> list[bytes]:
    """The keys of put number ``batch`` of a child; 1-4 keys, some of them from
    a pool shared by all trials (so puts skip stored keys and chunks end up with
    dead rows)."""
    rng = random.Random(f"crash:{trial_seed}:{batch}")
    keys: list[bytes] = []
    for j in range(rng.randint(1, CRASH_MAX_BLOCKS)):
        if rng.random() < 0.3:
            name = f"pool:{rng.randrange(12)}"
        else:
            name = f"own:{trial_seed}:{batch}:{j}"
        key = hashlib.blake2b(name.encode(), digest_size=16).digest()
        if key not in keys:
            keys.append(key)
    return keys


def install_hooks(
    phase, rng: random.Random, target: int | None, armed: list[bool]
) -> None:
    """Wrap the publish steps of this (child) process: announce each phase in
    ``phase``; without ``target`` nap 0-3 ms in each, with one wait in
    ``target`` until killed, once ``armed[0]`` is set (before that, stay quiet so
    the parent does not kill early)."""
    import npukv_store.store.index as index_mod

    def enter(value: int) -> None:
        if target is None:
            phase.value = value
            time.sleep(rng.uniform(0, 0.003))
        elif armed[0]:
            phase.value = value
            if value == target:
                time.sleep(_TARGET_NAP_S)

    real_fsync, real_rename = os.fsync, os.rename
    real_commit = index_mod.Index.commit_chunk
    real_touch_in = index_mod.Index._touch_in
    real_unpublish_in = index_mod.Index._unpublish_in

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the tmp chunk, not the dir
            enter(PHASE_TMP_WRITTEN)
        real_fsync(fd)

    def rename(src, dst, **kwargs):
        real_rename(src, dst, **kwargs)
        if str(dst).endswith(".safetensors"):
            enter(PHASE_RENAMED)

    def touch_in(self, txn, chunk_ids, now_ns):
        enter(PHASE_IN_TXN)  # the first step of every commit transaction
        return real_touch_in(self, txn, chunk_ids, now_ns)

    def unpublish_in(self, txn, record, **kwargs):
        enter(PHASE_EVICTING)
        return real_unpublish_in(self, txn, record, **kwargs)

    def commit_chunk(self, record, **kwargs):
        result = real_commit(self, record, **kwargs)
        enter(PHASE_EVICTED if result.victims else PHASE_COMMITTED)
        return result

    os.fsync, os.rename = fsync, rename
    index_mod.Index.commit_chunk = commit_chunk
    index_mod.Index._touch_in = touch_in
    index_mod.Index._unpublish_in = unpublish_in
