"""One store handle's side of admission (docs/decisions/0069): decide which
blocks of a save are written, and carry what it saw to the shared state.

Runs in: any process with a store handle; thread-safe.

    note_asked()   - the keys a lookup asked for (auto: the shadow's sample)
    admit()        - how many leading blocks of a save to write (a read)
    note_written() - bytes a commit wrote (the write budget)
    in_txn()       - the pending changes, for an index write transaction to
                     apply (a commit's, an eviction's or the touch flush's)
    mode           - what saves use now (refreshed by every applied change)

A save must not wait for the index's writer lock (it runs on the model's
step: ``begin_save``), so, like LRU touches, everything it learns is
collected here and written by the next transaction of this handle: a commit
of the background writer, or the touch flusher about once a second. The
ghost is read in a read transaction (never blocked). A process killed before
that loses at most a second of hints: a block declined twice may be
declined a third time.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

import lmdb
import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.store import index_admission as table
from npukv_store.store.admission import (
    BUDGET_WINDOW_S,
    AdmissionTuning,
    MemoryKeys,
    Mode,
    Scores,
    Shadow,
    admitted_run,
    choose_mode,
    ghost_capacity,
    key_prefix,
    sample_threshold,
    shadow_capacity,
    trim,
)
from npukv_store.store.index import Index, InTxn
from npukv_store.store.index_rows import KEY as KEY_BYTES
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.stats import StoreCounters

#: lookups kept between flushes (beyond: dropped, the shadow is a sample)
MAX_PENDING_LOOKUPS = 1 << 12
MAX_PENDING_GHOST = 1 << 16
DAY_S = 86400.0


class Admitter:
    """Admission for one store handle over the directory's shared state."""

    def __init__(
        self,
        index: Callable[[], Index],
        config: StoreConfig,
        block_bytes: int,
        counters: StoreCounters | None = None,
        tuning: AdmissionTuning | None = None,
    ) -> None:
        self._index = index
        self.counters = counters or StoreCounters()
        self.policy = config.admission
        self.tuning = tuning or AdmissionTuning()
        per_block = self.tuning.block_bytes or block_bytes
        blocks = max(1, int(config.capacity // max(per_block, 1)))
        self.capacity_blocks = blocks
        self.threshold = sample_threshold(blocks, self.tuning)
        self.shadow_blocks = shadow_capacity(blocks, self.tuning)
        self.ghost_limit = ghost_capacity(blocks, self.tuning)
        self.rate = config.write_budget / DAY_S  # bytes a second; 0: no budget
        self.bucket_size = self.rate * BUDGET_WINDOW_S
        self._lock = threading.Lock()
        self._asks: list[tuple[bytes, ...]] = []  # lookups' chains
        #: blocks for the ghost, not yet in it -> whether declined
        self._ghost_add: dict[int, bool] = {}
        #: the blocks last handed to a transaction, which may not have
        #: committed yet when the next save reads the ghost (bounded, oldest
        #: dropped: the index's ghost is the truth once committed)
        self._ghost_recent: OrderedDict[int, bool] = OrderedDict()
        self._ghost_drop: set[int] = set()  # admitted from the ghost
        self._deltas: dict[bytes, dict[str, int]] = {}
        self._written = 0
        self.mode = Mode.SECOND_SIGHT if self.policy == "second_sight" else Mode.ALL
        self.scores = Scores()  # the directory's: the record of the most asks
        self.budget_left = 1.0
        #: this process's shadow of both modes (in memory: an ask costs three
        #: dict operations, not twenty LMDB ones), over every process's
        #: sampled asks (the index's ask log); its scores go to the index,
        #: named by ``process_id``
        self.process_id = secrets.token_bytes(8)
        self.own_scores = Scores()
        self.shadow = Shadow(
            MemoryKeys(), MemoryKeys(), MemoryKeys(), self.shadow_blocks,
            max(1, int(self.shadow_blocks * self.tuning.ghost_per_block)),
            self.tuning,
        )  # fmt: skip
        self._shadow_lock = threading.Lock()
        self._asked = False  # whether this process looks up (runs a shadow)
        self._ask_position = 0  # the last ask log entry the shadow ran
        #: asks the handle to apply the pending changes soon (the touch
        #: flusher's :meth:`~.touches.TouchRecorder.soon`)
        self.on_decline: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        """Whether anything is kept: ``all`` without a budget keeps nothing
        (every block is written; admission costs nothing)."""
        return self.policy != "all" or self.rate > 0

    # -- the save's and the lookup's side ------------------------------------------

    def note_asked(self, keys: Sequence[bytes]) -> bool:
        """A lookup asked for ``keys``: kept as they are (the sampling runs
        in the flush, off the lookup's path). Whether a flush has work."""
        if self.policy != "auto" or not keys:
            return False
        self._asked = True
        with self._lock:
            if len(self._asks) >= MAX_PENDING_LOOKUPS:
                return True  # the shadow is a sample: dropping some is fine
            self._asks.append(tuple(keys))
        return True

    def _sampled(self, keys: Sequence[bytes]) -> list[int]:
        """The prefixes of ``keys`` the shadow samples: one comparison per
        key in numpy (run by the flush, before its transaction)."""
        if not keys:
            return []
        joined = b"".join(keys)
        if len(joined) != KEY_BYTES * len(keys):  # not all 16 bytes: the slow way
            return [p for p in map(key_prefix, keys) if p < self.threshold]
        prefixes = np.frombuffer(joined, dtype="<u8")[::2]
        if self.threshold < 1 << 64:
            prefixes = prefixes[prefixes < np.uint64(self.threshold)]
        return [int(p) for p in prefixes.tolist()]

    def admit(self, keys: Sequence[bytes], tenant: bytes) -> int:
        """How many leading ``keys`` (a save's blocks that are not stored,
        in chain order) are written; the rest are declined and remembered."""
        if not keys:
            return 0
        if not self.active:
            self._count(tenant, admitted_blocks=len(keys))
            return len(keys)
        prefixes = [key_prefix(k) for k in keys]
        mode = self.mode
        with self._lock:
            pending = {
                p: self._ghost_add.get(p, self._ghost_recent.get(p, False))
                for p in prefixes
                if p in self._ghost_add or p in self._ghost_recent
            }
        try:
            index = self._index()
            with index.begin_read() as txn:
                tags = table.in_ghost(txn, index.admission_db, prefixes)
        except lmdb.Error:  # a hint: without it, nothing was seen before
            tags = [None] * len(prefixes)
        declined = {
            p: tag == table.DECLINED
            for p, tag in zip(prefixes, tags, strict=True)
            if tag is not None
        }
        declined.update(pending)
        seen = set(declined)
        lost = sum(declined.values())  # declined before, brought again
        run = admitted_run(mode, prefixes, seen.__contains__)
        remember_written = self.tuning.ghost_keeps_written
        with self._lock:
            for p in prefixes[:run]:
                if remember_written:  # refreshed: it stays "seen"
                    if len(self._ghost_add) < MAX_PENDING_GHOST:
                        self._ghost_add[p] = False
                elif p in seen:
                    self._ghost_drop.add(p)
                    self._ghost_add.pop(p, None)
            for p in prefixes[run:]:
                if len(self._ghost_add) < MAX_PENDING_GHOST:
                    self._ghost_add[p] = True
        self._count(
            tenant,
            admitted_blocks=run,
            declined_blocks=len(keys) - run,
            lost_hit_blocks=lost,
        )
        self.counters.add(lost_hit_blocks=lost)
        if run < len(keys) and self.on_decline is not None:
            self.on_decline()  # no commit follows to carry the ghost entries
        return run

    def note_written(self, nbytes: int, tenant: bytes) -> None:
        """A commit of ``nbytes`` (the budget's, and the counters')."""
        self._count(tenant, written_bytes=nbytes)
        with self._lock:
            self._written += nbytes

    def _count(self, tenant: bytes, **deltas: int) -> None:
        with self._lock:
            named = self._deltas.setdefault(tenant, {})
            for name, delta in deltas.items():
                named[name] = named.get(name, 0) + delta

    # -- the shared state's side --------------------------------------------------

    def _ask_shadow(
        self,
        txn: lmdb.Transaction,
        db: lmdb._Database,
        seq: table.SeqCounter,
        sampled: list[int],
    ) -> Scores | None:
        """Log this process's sampled asks, then run every process's asks
        logged since this shadow's last run through it (in log order: the
        directory's traffic, not this process's share of it). A copy of its
        scores after them; None for a process that never looked up (a
        worker that only saves reads the others' scores)."""
        table.append_asks(txn, db, sampled, seq)
        if not self._asked:
            return None
        new, self._ask_position = table.asks_since(txn, db, self._ask_position)
        with self._shadow_lock:
            for prefix in new:
                self.shadow.ask(prefix, self.own_scores)
            return replace(self.own_scores) if new else None

    def due(self) -> InTxn | None:
        """:meth:`in_txn` when there is something to apply, or the mode
        must be refreshed (a spent budget refills with no commit); else None
        (the touch flusher's hook)."""
        with self._lock:
            busy = self._asks or self._ghost_add or self._ghost_drop or self._deltas
        if busy or self.mode is Mode.NONE:
            return self.in_txn()
        return None

    def in_txn(self) -> InTxn:
        """What an index write transaction runs to apply the pending changes
        (and count its victims written and evicted unread)."""
        with self._lock:
            asks, self._asks = self._asks, []
            ghost_add, self._ghost_add = self._ghost_add, {}
            ghost_drop, self._ghost_drop = self._ghost_drop, set()
            recent = self._ghost_recent
            for prefix in ghost_drop:
                recent.pop(prefix, None)
            recent.update(ghost_add)
            while len(recent) > MAX_PENDING_GHOST:
                recent.popitem(last=False)
            deltas, self._deltas = self._deltas, {}
            written, self._written = self._written, 0
        # sampled here, before the transaction: it holds the writer lock
        sampled = [p for chain in asks for p in self._sampled(chain)]

        def apply(txn: lmdb.Transaction, victims: Sequence[ChunkRecord]) -> None:
            index = self._index()
            db = index.admission_db
            for victim in victims:
                if victim.last_access_ns <= victim.created_ns:  # never read
                    named = deltas.setdefault(victim.tenant, {})
                    named["wasted_write_blocks"] = (
                        named.get("wasted_write_blocks", 0) + victim.live_rows
                    )
                    self.counters.add(wasted_write_blocks=victim.live_rows)
            self._apply(txn, db, sampled, ghost_add, ghost_drop, written)
            table.add_counters(txn, db, deltas)

        return apply

    def _apply(
        self,
        txn: lmdb.Transaction,
        db: lmdb._Database,
        sampled: list[int],
        ghost_add: dict[int, bool],
        ghost_drop: set[int],
        written: int,
    ) -> None:
        if not self.active:
            return
        now = time.time_ns()
        seq = table.SeqCounter(txn, db)
        own = self._ask_shadow(txn, db, seq, sampled)
        scores = table.publish_scores(txn, db, self.process_id, own, now)
        if ghost_add or ghost_drop:
            ghost = table.LmdbKeys(txn, db, table.GHOST, seq)
            for prefix in ghost_drop:
                ghost.discard(prefix)
            for prefix, was_declined in ghost_add.items():
                ghost.push(prefix, table.DECLINED if was_declined else b"")
            trim(ghost, self.ghost_limit)
        seq.write()
        budget_left = 1.0
        if self.rate > 0:
            bucket = table.bucket(txn, db, self.bucket_size)
            bucket.spend(written, now, self.rate, self.bucket_size)
            table.write_bucket(txn, db, bucket)
            budget_left = bucket.tokens / self.bucket_size
        self.scores = scores
        self.budget_left = budget_left
        self.mode = choose_mode(
            self.policy, scores, budget_left, self.tuning, self.shadow_blocks
        )
