"""Block-level cache simulations of a prefix-sharing trace (bench/trace.py).

Pure Python, deterministic, no I/O. A trace is a list of requests, each a
chain of block ids (a prompt's 512-token blocks, Mooncake's ``hash_ids``): a
shared leading run of ids is a shared prefix, so a block id implies its whole
prefix. Every simulator serves a request as vLLM's connector does: the hit is
the longest cached prefix of the chain, and only the blocks after it can be
saved (prefix-closed: a block is kept only while its parent is). Capacity is
in blocks.

    simulate_lru()          exact block-level LRU, every missed block written
    simulate_second_sight() LRU, a block written only on its second miss (its
                            ghost memory of first misses is unbounded)
    simulate_auto()         LRU whose saves are filtered by the store's own
                            admission rules (npukv_store/store/admission.py:
                            policy ``auto``, ``all`` or ``second_sight``),
                            over in-memory tables, as the store runs them
    simulate_second_sight_bounded()
                            simulate_auto() in policy ``second_sight``: the
                            directory's bounded ghost, not an unbounded one
    simulate_opt()          Belady's OPT with bypass: evict the block whose
                            next use is farthest, never store one whose next
                            use is farther than every cached block's
    simulate()              one of them by name
    SimResult               blocks/tokens requested and hit, blocks written;
                            hit_ratio, token_hit_ratio, written_ratio
    block_key()             a trace block's 16-byte store key (bench/trace.py)

Prefix closure without a tree walk: a use of a block is a use of its whole
prefix, so LRU orders each request's blocks deepest first and its root last
(a parent is always more recent than its cached children, and the least
recently used block is a leaf); OPT breaks ties in next use by depth
(a child's next use is never before its parent's, so the farthest block with
the deepest position is a leaf). With the hits of a request counted as the
stream of its blocks in chain order, OPT is Belady's optimum of that stream
(bypass allowed), so no policy, prefix-closed or not, hits more blocks:
tests/harness/test_trace_sim.py checks it against a brute force on tiny
traces.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from npukv_store.store.admission import (
    AdmissionTuning,
    MemoryKeys,
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

BLOCK_TOKENS = 512  # Mooncake's block: one hash id per 512 prompt tokens
NEVER = 1 << 62  # the next use of a block that is not used again

Chain = Sequence[int]


@dataclass
class SimResult:
    """What one policy did over a trace (blocks; tokens where said)."""

    policy: str
    capacity: int
    requested_blocks: int = 0
    hit_blocks: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    written_blocks: int = 0
    saves: int = 0  # requests that wrote at least one block
    #: per request, the hit length in blocks (kept only when asked)
    hits: list[int] = field(default_factory=list)
    #: admission (simulate_auto): blocks a save brought that were declined;
    #: blocks a save brought that were in the ghost (declined before and
    #: asked again: each a miss a write-all cache might have hit); the
    #: ghost's most keys after a save; saves per mode (Mode's names)
    declined: int = 0
    lost_hits: int = 0
    ghost_peak: int = 0
    modes: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        if not self.requested_tokens:
            return 0.0
        return self.hit_tokens / self.requested_tokens

    @property
    def written_ratio(self) -> float:
        """Blocks written over blocks requested (= bytes: blocks are one size)."""
        if not self.requested_blocks:
            return 0.0
        return self.written_blocks / self.requested_blocks

    @property
    def blocks_per_save(self) -> float:
        return self.written_blocks / self.saves if self.saves else 0.0


def block_key(block: int) -> bytes:
    """The 16-byte store key of trace block ``block`` (bench/trace.py's)."""
    return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16).digest()


def block_tokens(input_length: int | None, blocks: int) -> list[int]:
    """Tokens of each of a request's ``blocks`` blocks: 512 each, the last one
    what ``input_length`` leaves (512 where it is unknown or inconsistent)."""
    tokens = [BLOCK_TOKENS] * blocks
    if blocks and input_length is not None:
        tail = input_length - BLOCK_TOKENS * (blocks - 1)
        if 0 < tail <= BLOCK_TOKENS:
            tokens[-1] = tail
    return tokens


class _Tally:
    """Counts a request's hit and its tokens into a SimResult."""

    def __init__(
        self, result: SimResult, lengths: Sequence[int | None] | None, keep: bool
    ) -> None:
        self.result, self.lengths, self.keep = result, lengths, keep

    def add(self, i: int, chain: Chain, hit: int, written: int) -> None:
        r = self.result
        length = self.lengths[i] if self.lengths is not None else None
        tokens = block_tokens(length, len(chain))
        r.requested_blocks += len(chain)
        r.hit_blocks += hit
        r.requested_tokens += sum(tokens)
        r.hit_tokens += sum(tokens[:hit])
        r.written_blocks += written
        r.saves += written > 0
        if self.keep:
            r.hits.append(hit)


def _prefix_hit(chain: Chain, cached: Callable[[int], bool]) -> int:
    hit = 0
    for block in chain:
        if not cached(block):
            break
        hit += 1
    return hit


#: a save's admission: (chain, hit, limit) -> the end of the blocks written
#: (hit <= end <= limit: chain[hit:end] are written)
Admit = Callable[[Chain, int, int], int]


def _lru(
    trace: Sequence[Chain],
    capacity: int,
    result: SimResult,
    admit: Admit | None,
    lengths: Sequence[int | None] | None,
    keep_hits: bool,
    check: Callable[[set[int]], None] | None,
) -> SimResult:
    tally = _Tally(result, lengths, keep_hits)
    cache: OrderedDict[int, None] = OrderedDict()  # oldest first
    for i, chain in enumerate(trace):
        hit = _prefix_hit(chain, cache.__contains__)
        limit = min(len(chain), capacity)  # a prefix longer than the cache
        end = limit if admit is None else admit(chain, hit, limit)
        for block in chain[:hit]:  # the hit path is this request's: not a victim
            del cache[block]
        new = max(end - hit, 0)
        while len(cache) + hit + new > capacity:
            cache.popitem(last=False)  # the least recent: a leaf
        for j in range(max(end, hit) - 1, -1, -1):  # deepest first, root last
            cache[chain[j]] = None
        tally.add(i, chain, hit, new)
        if check is not None:
            check(set(cache))
    return result


def _unbounded_second_sight() -> Admit:
    ghost: set[int] = set()  # blocks missed once, never forgotten

    def admit(chain: Chain, hit: int, limit: int) -> int:
        end = hit
        while end < limit and chain[end] in ghost:
            end += 1
        ghost.update(chain[end:])  # seen once: written when missed again
        return end

    return admit


def simulate_lru(
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    *,
    keep_hits: bool = False,
    check: Callable[[set[int]], None] | None = None,
) -> SimResult:
    """Exact block-level LRU of ``capacity`` blocks, every missed block of a
    request written (up to capacity). ``lengths``: each request's input
    tokens (its last block may be partial). ``check`` sees the cached set
    after every request (tests)."""
    result = SimResult("lru", capacity)
    return _lru(trace, capacity, result, None, lengths, keep_hits, check)


def simulate_second_sight(
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    *,
    keep_hits: bool = False,
    check: Callable[[set[int]], None] | None = None,
) -> SimResult:
    """LRU where a missed block is written only on its second miss: a first
    miss only records it in a ghost set (unbounded, never forgotten: a block
    evicted and missed again is written at once). Prefix-closed: a request
    writes its missed blocks up to the first one missed for the first time."""
    result = SimResult("second_sight", capacity)
    admit = _unbounded_second_sight()
    return _lru(trace, capacity, result, admit, lengths, keep_hits, check)


class _Admission:
    """The store's admission of saves (npukv_store/store/admission.py) over
    in-memory tables: the shadows see every block of every request whose
    key is sampled, in chain order; a save's blocks after the hit are
    filtered by the mode chosen now, and the ones declined go into the
    directory's bounded ghost (a block found there is written in second
    sight)."""

    def __init__(
        self, capacity: int, policy: str, tuning: AdmissionTuning, result: SimResult
    ) -> None:
        self.policy, self.tuning, self.result = policy, tuning, result
        self.threshold = sample_threshold(capacity, tuning)
        size = shadow_capacity(capacity, tuning)
        self.shadow = Shadow(
            MemoryKeys(),
            MemoryKeys(),
            MemoryKeys(),
            size,
            math.ceil(size * tuning.ghost_per_block),
            tuning,
        )
        self.scores = Scores()
        self.ghost = MemoryKeys()  # the directory's declined blocks
        self.ghost_limit = ghost_capacity(capacity, tuning)
        self.prefixes: dict[int, int] = {}  # block -> key_prefix(block_key())

    def _prefix(self, block: int) -> int:
        prefix = self.prefixes.get(block)
        if prefix is None:
            prefix = self.prefixes[block] = key_prefix(block_key(block))
        return prefix

    def __call__(self, chain: Chain, hit: int, limit: int) -> int:
        keys = [self._prefix(block) for block in chain]
        for key in keys:
            if key < self.threshold:
                self.shadow.ask(key, self.scores)
        save = keys[hit:limit]
        if not save:
            return hit
        r, ghost = self.result, self.ghost
        mode = choose_mode(
            self.policy, self.scores, 1.0, self.tuning, self.shadow.capacity
        )
        r.modes[mode.name] = r.modes.get(mode.name, 0) + 1
        r.lost_hits += sum(key in ghost for key in save)
        n = admitted_run(mode, save, ghost.__contains__)
        remember_all = self.tuning.ghost_keeps_written
        for key in save[:n]:
            if remember_all:
                ghost.push(key)
            else:
                ghost.discard(key)
        for key in save[n:]:
            ghost.push(key)
        trim(ghost, self.ghost_limit)
        r.declined += len(save) - n
        r.ghost_peak = max(r.ghost_peak, len(ghost))
        return hit + n


def simulate_auto(
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    tuning: AdmissionTuning = AdmissionTuning(),  # noqa: B008 (frozen)
    policy: str = "auto",
    *,
    keep_hits: bool = False,
    check: Callable[[set[int]], None] | None = None,
) -> SimResult:
    """Block-level LRU (as simulate_lru) whose saves the store's admission
    rules filter, ``policy`` one of admission.POLICIES: per request, in
    chain order, every block whose key (``block_key``) is sampled is an ask
    to the Shadow; then the blocks after the hit (up to capacity) are cut to
    ``admitted_run(choose_mode(policy, scores, 1.0, tuning), ...)``, a block
    ``seen`` when it is in the directory's ghost of declined blocks
    (``ghost_capacity`` of them, the oldest dropped). In policy ``all`` it is
    simulate_lru exactly. The result also counts ``declined``, ``lost_hits``,
    ``ghost_peak`` and the saves per mode."""
    result = SimResult(policy, capacity)
    admit = _Admission(capacity, policy, tuning, result)
    return _lru(trace, capacity, result, admit, lengths, keep_hits, check)


def simulate_second_sight_bounded(
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    tuning: AdmissionTuning = AdmissionTuning(),  # noqa: B008 (frozen)
    *,
    keep_hits: bool = False,
    check: Callable[[set[int]], None] | None = None,
) -> SimResult:
    """simulate_auto() in policy ``second_sight``: write-on-second-sight with
    the directory's bounded ghost (simulate_second_sight's is unbounded)."""
    result = simulate_auto(
        trace,
        capacity,
        lengths,
        tuning,
        "second_sight",
        keep_hits=keep_hits,
        check=check,
    )
    result.policy = "second_sight_bounded"
    return result


def next_uses(trace: Sequence[Chain]) -> list[list[int]]:
    """Per request and position, the index of the next request that uses the
    same block (NEVER where none does)."""
    later: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        chain = trace[i]
        out[i] = [later.get(block, NEVER) for block in chain]
        for block in chain:
            later[block] = i
    return out


def simulate_opt(
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    *,
    keep_hits: bool = False,
    check: Callable[[set[int]], None] | None = None,
) -> SimResult:
    """Belady's OPT, prefix-closed, with bypass (offline: it reads the whole
    trace first). A block's priority is ``(next request using it, its
    depth)``; a missed block is stored in chain order while it has room or
    while some cached block's priority is later than its own (that one is
    evicted); else it and the rest of its chain are not stored."""
    result = SimResult("opt", capacity)
    tally = _Tally(result, lengths, keep_hits)
    uses = next_uses(trace)
    depth: dict[int, int] = {}
    cached: dict[int, tuple[int, int]] = {}  # block -> its current priority
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazy

    def store(block: int, key: tuple[int, int]) -> None:
        cached[block] = key
        heapq.heappush(heap, (-key[0], -key[1], block))

    def farthest() -> tuple[tuple[int, int], int]:
        while True:
            neg_use, neg_depth, block = heap[0]
            key = (-neg_use, -neg_depth)
            if cached.get(block) == key:
                return key, block
            heapq.heappop(heap)  # stale: re-keyed or evicted

    for i, chain in enumerate(trace):
        for j, block in enumerate(chain):
            depth.setdefault(block, j)
        hit = _prefix_hit(chain, cached.__contains__)
        for j in range(hit):  # used now: re-keyed to its next use
            store(chain[j], (uses[i][j], depth[chain[j]]))
        written = 0
        for j in range(hit, min(len(chain), capacity)):
            key = (uses[i][j], depth[chain[j]])
            if key[0] == NEVER:
                break  # never used again, nor is any block after it
            if len(cached) >= capacity:
                victim_key, victim = farthest()
                if victim_key <= key:
                    break  # bypass: this block would be the farthest
                del cached[victim]
                heapq.heappop(heap)
            store(chain[j], key)
            written += 1
        tally.add(i, chain, hit, written)
        if check is not None:
            check(set(cached))
        if len(heap) > 4 * capacity + 64:  # drop stale entries now and then
            heap = [(-k[0], -k[1], b) for b, k in cached.items()]
            heapq.heapify(heap)
    return result


SIMULATORS: dict[str, Callable[..., SimResult]] = {
    "lru": simulate_lru,
    "second_sight": simulate_second_sight,
    "second_sight_bounded": simulate_second_sight_bounded,
    "auto": simulate_auto,
    "opt": simulate_opt,
}


def simulate(
    policy: str,
    trace: Sequence[Chain],
    capacity: int,
    lengths: Sequence[int | None] | None = None,
    **kw: object,
) -> SimResult:
    """``policy`` (a key of SIMULATORS) over ``trace`` at ``capacity`` blocks."""
    return SIMULATORS[policy](trace, capacity, lengths, **kw)
