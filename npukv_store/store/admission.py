"""Admission: which of the blocks a save brings are written (docs/decisions/0069).

Runs in: any process (pure rules, no I/O, no LMDB). The index keeps the
shared state in its ``admission`` database (:mod:`.index_admission`); the
trace benchmark's simulation runs these same rules over in-memory tables
(bench/harness/trace_sim.py), so the store is measured against a simulation
of its own policy.

    Mode            - ALL (write every missed block), SECOND_SIGHT (write a
                      block the second time a save brings it), NONE (the
                      write budget is spent: write nothing)
    OrderedKeys     - a bounded recency-ordered set of 8-byte key prefixes
    MemoryKeys      - one in a dict (the simulation's, and the tests')
    Shadow          - two sampled shadow caches, one per mode, scored on the
                      same asks: which mode would hit more at this capacity
    Scores          - their decayed hit counts
    choose_mode()   - the mode of a policy, given the scores and the budget
    admitted_run()  - how many leading blocks of a save a mode writes
    TokenBucket     - the write budget's bytes, refilled at a rate

Why a shadow and not a fixed rule: on a production trace write-on-second-
sight doubles LRU's hits at 1-2% of the unique blocks with a tenth of the
writes, ties it at 5% and loses a quarter of them at 10-25% (the first reuse
matters once the cache is large). Which side of that line a directory is on
depends on its capacity and its traffic, so ``auto`` measures both modes on
a spatial sample of the keys (SHARDS, Waldspurger et al., FAST '15: a key is
sampled when its hash is below a threshold, and a cache of the capacity
scaled by the same rate sees the sample's hit ratio) and uses the better
one, preferring second sight unless write-all wins by a margin (it writes a
fraction of the bytes). Write by hand: no library keeps a shared,
bounded, crash-safe shadow of two policies.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("auto", "all", "second_sight")
#: hits and writes of write-all, of second sight, and the asks
SCORES = struct.Struct("<ddddd")


class Mode(enum.IntEnum):
    """What a save writes now."""

    NONE = 0  # the write budget is spent
    SECOND_SIGHT = 1
    ALL = 2


@dataclass(frozen=True)
class AdmissionTuning:
    """The constants of ``auto`` (tuned on the trace benchmark: 0069)."""

    #: sampled keys per shadow cache: the sampling rate is this over the
    #: capacity in blocks (1 where the capacity is smaller)
    shadow_blocks: int = 4096
    #: the second-sight shadow's (and the directory's) ghost of declined
    #: blocks holds this many per block of capacity
    ghost_per_block: float = 4.0
    #: the directory's ghost never holds more than this (16 MiB of LMDB)
    ghost_max: int = 1 << 18
    #: write-all is chosen only while each write it adds over second sight
    #: brings this many hits more (a write's cost, in hits: SSD wear and
    #: write bandwidth taken from reads)
    margin: float = 0.1
    #: the ghost remembers every block a save brings, written or not (a
    #: block evicted and brought again is then written at once in second
    #: sight); False: only the declined ones
    ghost_keeps_written: bool = True
    #: bytes a block takes on disk, for the capacity in blocks (None: the
    #: namespace's block bytes; chunk headers are noise at real block sizes,
    #: not at the trace benchmark's 512-byte blocks, which pass their own)
    block_bytes: float | None = None
    #: the scores halve every this many shadow capacities of sampled asks
    window: float = 8.0


def key_prefix(key: bytes) -> int:
    """The 8 bytes of a block key the admission tables keep (keys are
    hashes: a prefix collides with odds of 2^-64 per pair, and a collision
    only admits a block)."""
    return int.from_bytes(key[:8], "little")


def sample_threshold(capacity_blocks: int, tuning: AdmissionTuning) -> int:
    """Keys whose prefix is below this are sampled by the shadow."""
    rate = min(1.0, tuning.shadow_blocks / max(capacity_blocks, 1))
    return min(1 << 64, math.ceil(rate * (1 << 64)))


def shadow_capacity(capacity_blocks: int, tuning: AdmissionTuning) -> int:
    """Blocks each shadow cache holds: the capacity at the sampling rate."""
    return max(1, min(capacity_blocks, tuning.shadow_blocks))


def ghost_capacity(capacity_blocks: int, tuning: AdmissionTuning) -> int:
    """Declined blocks the directory remembers."""
    wanted = math.ceil(tuning.ghost_per_block * max(capacity_blocks, 1))
    return min(tuning.ghost_max, max(64, wanted))


class OrderedKeys(Protocol):
    """A set of key prefixes in recency order (oldest first)."""

    def __contains__(self, key: int) -> bool: ...
    def __len__(self) -> int: ...
    def push(self, key: int) -> None:
        """Add ``key`` as the newest (moving it there if present)."""

    def discard(self, key: int) -> bool:
        """Remove ``key``; whether it was there."""

    def pop_oldest(self) -> int | None:
        """Remove and return the oldest key (None when empty)."""


class MemoryKeys:
    """:class:`OrderedKeys` in a dict."""

    def __init__(self) -> None:
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def push(self, key: int) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def discard(self, key: int) -> bool:
        return self._keys.pop(key, 0) is None

    def pop_oldest(self) -> int | None:
        if not self._keys:
            return None
        return self._keys.popitem(last=False)[0]


def trim(keys: OrderedKeys, limit: int) -> None:
    """Drop the oldest keys until at most ``limit`` are left."""
    while len(keys) > limit:
        keys.pop_oldest()


@dataclass
class Scores:
    """Decayed hit and write counts of the two shadow caches, over the
    same asks."""

    hits_all: float = 0.0
    hits_second_sight: float = 0.0
    asks: float = 0.0
    writes_all: float = 0.0
    writes_second_sight: float = 0.0

    def pack(self) -> bytes:
        return SCORES.pack(
            self.hits_all, self.hits_second_sight, self.asks, self.writes_all,
            self.writes_second_sight,
        )  # fmt: skip

    def halve(self) -> None:
        self.hits_all /= 2
        self.hits_second_sight /= 2
        self.asks /= 2
        self.writes_all /= 2
        self.writes_second_sight /= 2

    @classmethod
    def unpack(cls, raw: bytes | None) -> Scores:
        if raw is None or len(raw) != SCORES.size:
            return cls()
        return cls(*SCORES.unpack(raw))


class Shadow:
    """The two modes' caches of the sampled keys, each an LRU of
    ``capacity`` blocks; second sight's also has its ghost of first asks."""

    def __init__(
        self,
        every: OrderedKeys,
        second: OrderedKeys,
        ghost: OrderedKeys,
        capacity: int,
        ghost_limit: int,
        tuning: AdmissionTuning,
    ) -> None:
        self.every, self.second, self.ghost = every, second, ghost
        self.capacity, self.ghost_limit, self.tuning = capacity, ghost_limit, tuning

    def ask(self, key: int, scores: Scores) -> None:
        """One sampled block asked for: each shadow serves it, the scores
        count their hits."""
        if key in self.every:
            scores.hits_all += 1
        else:
            scores.writes_all += 1
        self.every.push(key)
        trim(self.every, self.capacity)
        if key in self.second:
            scores.hits_second_sight += 1
            self.second.push(key)
        elif self.ghost.discard(key):
            scores.writes_second_sight += 1
            self.second.push(key)
            trim(self.second, self.capacity)
        else:
            self.ghost.push(key)
            trim(self.ghost, self.ghost_limit)
        scores.asks += 1
        if scores.asks >= self.tuning.window * self.capacity:
            scores.halve()


def choose_mode(
    policy: str,
    scores: Scores,
    budget_left: float,
    tuning: AdmissionTuning,
    warm_asks: float = 0.0,
) -> Mode:
    """The mode a save uses now.

    Args:
        policy: ``auto``, ``all`` or ``second_sight`` (config ``admission``).
        scores: the shadows' (only ``auto`` reads them).
        budget_left: the write budget's bucket over its size (1.0 without a
            budget): at or under 0 nothing is written, under a half at most
            second sight (over budget, admission tightens).
        warm_asks: ``auto`` writes everything until the shadows have seen
            this many asks (the shadow's capacity: a cache still filling
            loses nothing by a write, and the scores mean little yet).
    """
    if budget_left <= 0:
        return Mode.NONE
    if policy == "second_sight" or budget_left < 0.5:
        return Mode.SECOND_SIGHT
    if policy == "all":
        return Mode.ALL
    if scores.asks < warm_asks:
        return Mode.ALL
    gain = scores.hits_all - scores.hits_second_sight
    cost = scores.writes_all - scores.writes_second_sight
    if gain > tuning.margin * max(cost, 1.0):
        return Mode.ALL
    return Mode.SECOND_SIGHT  # and with no hit in either once warm: a scan


def admitted_run(mode: Mode, keys: Sequence[int], seen: Callable[[int], bool]) -> int:
    """How many leading ``keys`` (a save's blocks not stored, in chain
    order) are written: all in ALL, none in NONE, and in SECOND_SIGHT those
    up to the first one not ``seen`` before (declined before). A block
    after a declined one is declined too: saves stay prefix-closed."""
    if mode is Mode.ALL:
        return len(keys)
    if mode is Mode.NONE:
        return 0
    for i, key in enumerate(keys):
        if not seen(key):
            return i
    return len(keys)


@dataclass
class TokenBucket:
    """The write budget: ``tokens`` bytes may be written now; it refills at
    ``rate`` bytes a second up to ``size`` (an hour of the rate)."""

    tokens: float
    updated_ns: int

    def refilled(self, now_ns: int, rate: float, size: float) -> float:
        elapsed = max(0, now_ns - self.updated_ns) / 1e9
        return min(size, self.tokens + elapsed * rate)

    def spend(self, nbytes: int, now_ns: int, rate: float, size: float) -> None:
        self.tokens = self.refilled(now_ns, rate, size) - nbytes
        self.updated_ns = max(now_ns, self.updated_ns)


BUDGET_WINDOW_S = 3600.0  # the bucket holds an hour of the budget's rate
