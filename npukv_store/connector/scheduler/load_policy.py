"""Load or recompute: whether a stored prefix is worth loading, from measured costs.

Runs in: the EngineCore process. The workers measure (each load's seconds and
bytes, from the page cache and from disk apart; each step's compute seconds and
tokens) and send the samples back in the worker metadata of every step
(``NPUKVWorkerMetadata``); the scheduler side feeds them here and asks
:meth:`LoadPolicy.decide` for every hit it finds.

    LoadCosts     - seconds of one load: fixed + cached bytes x s_cache + disk
                    bytes x s_disk, fitted over the recent loads
    ComputeCosts  - seconds per prefill token: the slope of step seconds over
                    step tokens, fitted over recent steps that loaded nothing
    LoadPolicy    - the decision: the longest candidate prefix whose load is
                    expected to finish within ``(1 + load_margin)`` times its
                    recompute; all, the page-cached head, or none

Only time is at stake: a declined hit is recomputed, as a miss would be, so a
wrong estimate never changes an output. The policy is conservative: with
fewer than MIN_LOAD_SAMPLES loads or MIN_COMPUTE_SAMPLES steps measured it
loads every hit. While it declines hits no load is measured, so it lets one
load through every PROBE_INTERVAL_S; a probe that shows loads pay again
restarts the load fit from that probe (the samples before it describe a disk
that has changed), and the hits after it load while the fit refills.
docs/decisions/0024 has the model and the reasons for its constants.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

#: samples kept per model, and the half-life of their weight in samples: the
#: fit follows a disk that turns busy (or idle) within a few loads
WINDOW = 64
HALF_LIFE = 8.0
MIN_LOAD_SAMPLES = 4
MIN_COMPUTE_SAMPLES = 8
#: while hits are declined, one is loaded anyway when the newest load sample
#: is older than this: the only way to learn that loads are fast again
PROBE_INTERVAL_S = 5.0
#: a class of bytes (page cache or disk) with less than this share of the
#: recent bytes has no cost of its own: the blended fit prices it
MIN_CLASS_SHARE = 0.1

LOAD = "load"  # the whole hit
SHORTER = "shorter"  # only its head (the part the page cache holds)
RECOMPUTE = "recompute"  # none of it
PROBE = "probe"  # the whole hit, to measure, although recompute looked faster
DECISIONS = (LOAD, SHORTER, RECOMPUTE, PROBE)


def nonnegative_fit(
    columns: np.ndarray, y: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """Weighted least squares ``y ~ columns @ coef`` with every ``coef >= 0``.

    Exhaustive over the subsets of at most three columns (scipy's nnls would
    be a new dependency for a problem this small): the best fit among the
    subsets whose unconstrained solution is nonnegative, the others 0.
    """
    n = columns.shape[1]
    root = np.sqrt(weights)
    a = columns * root[:, None]
    b = y * root
    best = np.zeros(n)
    best_err = float(np.sum(b * b))
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if err < best_err - 1e-18:
                best_err = err
                best = np.zeros(n)
                best[cols] = coef
    return best


def _weights(count: int) -> np.ndarray:
    """The newest sample weighs 1, one HALF_LIFE older 0.5."""
    ages = np.arange(count - 1, -1, -1, dtype=np.float64)
    out: np.ndarray = 0.5 ** (ages / HALF_LIFE)
    return out


class LoadCosts:
    """Seconds of a load from its bytes (``observe``, then ``seconds``)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float, float, float] | None = None

    @property
    def count(self) -> int:
        return len(self._samples)

    def observe(self, seconds: float, cached_bytes: int, disk_bytes: int) -> None:
        if seconds >= 0 and cached_bytes + disk_bytes > 0:
            self._samples.append((seconds, cached_bytes, disk_bytes))
            self._fit = None

    def restart(self) -> None:
        """Forget every sample but the newest."""
        while len(self._samples) > 1:
            self._samples.popleft()
        self._fit = None

    def fitted(self) -> tuple[float, float, float, float]:
        """(fixed s, s per cached byte, s per disk byte, s per byte blended)."""
        if self._fit is None:
            data = np.array(self._samples, dtype=np.float64).reshape(-1, 3)
            w = _weights(len(data))
            seconds, cached, disk = data[:, 0], data[:, 1], data[:, 2]
            ones = np.ones(len(data))
            fixed, blended = nonnegative_fit(
                np.stack([ones, cached + disk], axis=1), seconds, w
            )
            per_cached = per_disk = blended
            share = float(np.sum(w * cached) / max(np.sum(w * (cached + disk)), 1.0))
            if MIN_CLASS_SHARE <= share <= 1 - MIN_CLASS_SHARE:
                f3, per_cached, per_disk = nonnegative_fit(
                    np.stack([ones, cached, disk], axis=1), seconds, w
                )
                fixed = f3
            self._fit = (float(fixed), float(per_cached), float(per_disk), blended)
        return self._fit

    def seconds(
        self, nbytes: int, cached_bytes: int | None = None, *, joins: bool = False
    ) -> float:
        """Expected seconds to load ``nbytes``, of which ``cached_bytes`` are
        in the page cache (None: unknown, priced at the recent mix). ``joins``:
        the load joins a step's load already planned, whose fixed cost that
        one pays (a step's loads run as one job)."""
        fixed, per_cached, per_disk, blended = self.fitted()
        if joins:
            fixed = 0.0
        if cached_bytes is None:
            return fixed + nbytes * blended
        cached_bytes = min(cached_bytes, nbytes)
        return fixed + cached_bytes * per_cached + (nbytes - cached_bytes) * per_disk


class ComputeCosts:
    """Seconds of prefill per token, from step samples (``observe``)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=WINDOW)
        self._per_token: float | None = None

    @property
    def count(self) -> int:
        return len(self._samples)

    def observe(self, seconds: float, tokens: int) -> None:
        if seconds > 0 and tokens > 0:
            self._samples.append((seconds, tokens))
            self._per_token = None

    def per_token(self) -> float:
        """The slope of step seconds over tokens (what a step's extra tokens
        cost, its fixed part paid anyway). Where the steps' sizes are too alike
        to tell the slope, the smallest seconds per token of any step: an
        upper bound, which favours loading."""
        if self._per_token is None:
            data = np.array(self._samples, dtype=np.float64).reshape(-1, 2)
            seconds, tokens = data[:, 0], data[:, 1]
            slope = 0.0
            if tokens.max() >= 2 * tokens.min():
                columns = np.stack([np.ones(len(data)), tokens], axis=1)
                slope = float(nonnegative_fit(columns, seconds, _weights(len(data)))[1])
            if slope <= 0:
                slope = float(np.min(seconds / tokens))
            self._per_token = slope
        return self._per_token


@dataclass(frozen=True, slots=True)
class Decision:
    blocks: int  # of the hit's blocks, how many to load (a prefix of them)
    kind: str  # one of DECISIONS
    load_s: float = 0.0  # the estimates it was made on (0: none yet)
    recompute_s: float = 0.0


class LoadPolicy:
    """``decide``: how much of a hit to load; see the module docstring."""

    def __init__(
        self,
        mode: str = "auto",
        margin: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mode = mode
        self.margin = margin
        self.loads = LoadCosts()
        self.compute = ComputeCosts()
        self._clock = clock
        self._last_load_sample = clock()
        #: a probe is out: tokens per byte of the hit it loads (to price the
        #: recompute of the load sample it yields)
        self._probe_tokens_per_byte = 0.0
        self._declining = False  # the last turn logged (see _log_turn)
        self._turn_logged = -1e9

    def observe_loads(self, samples: Iterable[tuple[float, int, int]]) -> None:
        for seconds, cached, disk in samples:
            self.loads.observe(seconds, cached, disk)
            self._last_load_sample = self._clock()
            if self._probe_tokens_per_byte:
                tokens = (cached + disk) * self._probe_tokens_per_byte
                recompute_s = tokens * self.compute.per_token()
                if seconds <= (1.0 + self.margin) * recompute_s:
                    self.loads.restart()  # the disk changed: refit from here
                self._probe_tokens_per_byte = 0.0

    def observe_steps(self, samples: Iterable[tuple[float, int]]) -> None:
        for seconds, tokens in samples:
            self.compute.observe(seconds, tokens)

    def measured(self) -> bool:
        return (
            self.loads.count >= MIN_LOAD_SAMPLES
            and self.compute.count >= MIN_COMPUTE_SAMPLES
        )

    def decide(
        self,
        blocks: int,
        block_bytes: int,
        block_tokens: int,
        cached_head: Callable[[], int] | None = None,
        *,
        joins: bool = False,
    ) -> Decision:
        """How many of a hit's ``blocks`` leading blocks to load.

        ``block_bytes`` is what one block costs to read (one worker's part),
        ``cached_head()`` how many leading blocks the page cache holds: asked
        only when loading the whole hit does not pay, to try its head.
        ``joins``: this step already loads another hit, so this one adds its
        bytes but not the fixed cost of a load.
        """
        decision = self._decide(blocks, block_bytes, block_tokens, cached_head, joins)
        if decision.kind in (LOAD, RECOMPUTE):
            self._log_turn(decision)
        return decision

    def _log_turn(self, decision: Decision) -> None:
        """One line when the policy turns from loading hits to declining them
        or back (at most one a minute): the operator sees why hits stopped."""
        declining = decision.kind == RECOMPUTE
        now = self._clock()
        if declining == self._declining or now - self._turn_logged < 60.0:
            return
        self._declining, self._turn_logged = declining, now
        logger.info(
            "npukv_store: load policy: %s (a hit's load expected %.1f ms, its "
            "recompute %.1f ms, margin %.2f)",
            "declining hits, recomputing them" if declining else "loading hits",
            decision.load_s * 1e3, decision.recompute_s * 1e3, self.margin,
        )  # fmt: skip

    def _decide(
        self,
        blocks: int,
        block_bytes: int,
        block_tokens: int,
        cached_head: Callable[[], int] | None,
        joins: bool,
    ) -> Decision:
        if blocks <= 0:
            return Decision(0, RECOMPUTE)
        if self.mode == "always" or not self.measured():
            return Decision(blocks, LOAD)
        per_token = self.compute.per_token()
        recompute_s = blocks * block_tokens * per_token
        load_s = self.loads.seconds(blocks * block_bytes, joins=joins)
        limit = 1.0 + self.margin
        if load_s <= limit * recompute_s:
            return Decision(blocks, LOAD, load_s, recompute_s)
        head = cached_head() if cached_head is not None else 0
        if 0 < head < blocks:
            head_bytes = head * block_bytes
            head_load = self.loads.seconds(head_bytes, head_bytes, joins=joins)
            head_recompute = head * block_tokens * per_token
            if head_load <= limit * head_recompute:
                return Decision(head, SHORTER, head_load, head_recompute)
        if self._clock() - self._last_load_sample >= PROBE_INTERVAL_S:
            self._last_load_sample = self._clock()  # one probe per interval
            self._probe_tokens_per_byte = block_tokens / max(block_bytes, 1)
            return Decision(blocks, PROBE, load_s, recompute_s)
        return Decision(0, RECOMPUTE, load_s, recompute_s)
