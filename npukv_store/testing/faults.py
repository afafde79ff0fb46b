"""Fault injection for tests: an I/O engine that fails the requests it is told to.

Runs in: a test process that wraps an engine itself, or any process started
with ``NPUKV_FAULTS`` set (``make_engine`` then wraps every engine it makes:
the store's readers and its background writer). Off by default; unset, the
only cost is one environment lookup per engine made (not per request).

    FaultRule      - one rule: which requests, what goes wrong, how often
    parse_faults() - "read:eio;write:enospc:after=2:count=1" -> rules
    FaultyEngine   - an IOEngine that applies rules to another engine's requests
    faults_from_env() - this process's rules for NPUKV_FAULTS, parsed once, so
                     every engine of the process shares their counters
    forget_env_faults() - parse again on the next engine (fresh counters)

Spec: rules separated by ``;``, each ``op:kind[:key=value...]``:

    op     read | write | any
    kind   eio     the request fails with -EIO, no byte moves
           enospc  it fails with -ENOSPC (a full disk, for writes)
           short   only the first half of its bytes move (rounded down to
                   4096, so an O_DIRECT request stays aligned); the result
                   says how many, as a read at EOF or a short write would
           slow    it is held ``ms`` milliseconds before it is submitted
                   (a slow disk; the submitting thread waits)
    p=F       probability per matching request (default 1.0)
    after=N   the first N matching requests pass untouched (default 0)
    count=N   at most N faults, then everything passes (default: no limit)
    ms=N      for slow (default 100)
    seed=N    for p < 1 (default 0)

Examples: ``read:eio`` (every read fails), ``read:short:p=0.3``,
``write:enospc:after=1:count=2``, ``write:slow:ms=300``.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from npukv_store.errors import ConfigError
from npukv_store.io.engine import READ, WRITE, Completion, IOEngine, IORequest

ENV = "NPUKV_FAULTS"
_OPS = {"read": (READ,), "write": (WRITE,), "any": (READ, WRITE)}
_ERRNO = {"eio": errno.EIO, "enospc": errno.ENOSPC}
_KINDS = (*_ERRNO, "short", "slow")
_KEYS = ("p", "after", "count", "ms", "seed")
_ALIGN = 4096


@dataclass
class FaultRule:
    """One rule of a fault spec; ``matched`` and ``injected`` count, over every
    engine sharing the rule, the requests it saw and the faults it caused."""

    op: str
    kind: str
    p: float = 1.0
    after: int = 0
    count: int | None = None
    ms: float = 100.0
    seed: int = 0
    matched: int = 0
    injected: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def fires(self, request: IORequest) -> bool:
        """Whether this rule hits ``request`` (and counts it if so)."""
        if request.op not in _OPS[self.op]:
            return False
        with self._lock:
            self.matched += 1
            if self.matched <= self.after:
                return False
            if self.count is not None and self.injected >= self.count:
                return False
            if self.p < 1.0 and self._rng.random() >= self.p:
                return False
            self.injected += 1
            return True


def parse_faults(spec: str) -> list[FaultRule]:
    """The rules of ``spec`` (see the module docstring).

    Raises:
        ConfigError: a rule that does not parse, naming it and what was expected.
    """
    rules = []
    for text in filter(None, (part.strip() for part in spec.split(";"))):
        fields = text.split(":")
        if len(fields) < 2 or fields[0] not in _OPS or fields[1] not in _KINDS:
            raise ConfigError(
                f"{ENV}: found rule {text!r}, expected op:kind[:key=value...] with "
                f"op in {', '.join(_OPS)} and kind in {', '.join(_KINDS)}"
            )
        options: dict[str, float | int] = {}
        for option in fields[2:]:
            key, _, value = option.partition("=")
            try:
                options[key] = float(value) if key in ("p", "ms") else int(value)
            except ValueError:
                key = ""  # reported below
            if key not in _KEYS:
                raise ConfigError(
                    f"{ENV}: found {option!r} in rule {text!r}, expected "
                    f"key=number with key in {', '.join(_KEYS)}"
                )
        rules.append(FaultRule(fields[0], fields[1], **options))  # type: ignore[arg-type]
    return rules


class FaultyEngine(IOEngine):
    """``inner`` with ``rules`` applied: the first rule that fires on a request
    decides what happens to it; requests no rule hits pass unchanged."""

    def __init__(self, inner: IOEngine, rules: Sequence[FaultRule]) -> None:
        self.inner = inner
        self.rules = list(rules)
        self.kind = f"faulty-{inner.kind}"
        self.queue_depth = inner.queue_depth
        self._failed: list[Completion] = []  # completions made up here

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight + len(self._failed)

    def submit(self, requests: Sequence[IORequest]) -> None:
        passed = []
        for request in requests:
            rule = next((r for r in self.rules if r.fires(request)), None)
            if rule is None:
                passed.append(request)
            elif rule.kind == "slow":
                time.sleep(rule.ms / 1000)
                passed.append(request)
            elif rule.kind == "short":
                shortened = _first_half(request)
                if shortened is None:  # under one page: nothing moves at all
                    self._failed.append(Completion(request.tag, 0))
                else:
                    passed.append(shortened)
            else:
                self._failed.append(Completion(request.tag, -_ERRNO[rule.kind]))
        if passed:
            self.inner.submit(passed)

    def reap(self, min_complete: int = 1) -> list[Completion]:
        out, self._failed = self._failed, []
        need = min(min_complete - len(out), self.inner.in_flight)
        if need > 0:
            out += self.inner.reap(need)
        return out

    def register_buffer(self, buffer: memoryview) -> bool:
        return self.inner.register_buffer(buffer)

    def close(self) -> None:
        self._failed = []
        self.inner.close()


def _first_half(request: IORequest) -> IORequest | None:
    """``request`` cut to the first half of its bytes, rounded down to whole
    pages; None when that leaves nothing."""
    buffers = request.buffer if isinstance(request.buffer, tuple) else (request.buffer,)
    keep = sum(len(b) for b in buffers) // 2 // _ALIGN * _ALIGN
    if keep == 0:
        return None
    kept = []
    for buffer in buffers:
        if keep <= 0:
            break
        kept.append(buffer[:keep])
        keep -= len(kept[-1])
    cut = kept[0] if len(kept) == 1 else tuple(kept)
    return IORequest(request.op, request.fd, request.offset, cut, request.tag)


_from_env: dict[str, list[FaultRule]] = {}
_from_env_lock = threading.Lock()


def faults_from_env() -> list[FaultRule]:
    """The rules ``NPUKV_FAULTS`` names, parsed once per distinct value, so all
    engines of the process share them (and their counters); [] when unset."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return []
    with _from_env_lock:
        if spec not in _from_env:
            _from_env[spec] = parse_faults(spec)
        return _from_env[spec]


def forget_env_faults() -> None:
    """Forget the rules parsed from ``NPUKV_FAULTS`` (tests: the next engine
    starts from fresh counters)."""
    with _from_env_lock:
        _from_env.clear()


def wrap_from_env(engine: IOEngine) -> IOEngine:
    """``engine`` wrapped in the rules of ``NPUKV_FAULTS``, or as it is."""
    rules = faults_from_env()
    return FaultyEngine(engine, rules) if rules else engine
