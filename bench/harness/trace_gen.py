"""A generator of prefix-sharing traces in Mooncake's format (bench/trace.py).

Multi-turn conversations and agent loops, with tunable reuse, single-use
share and arrival rate. Every request's chain starts with one shared system
prompt block (as Mooncake's conversation trace does: its block 0 is in every
request); a session's turn ``t + 1`` sends turn ``t``'s prompt, its answer and
a new message, so its chain extends turn ``t``'s full blocks. The last,
partial block of a prompt is its own (the next turn fills it: another hash),
so it is used once, as in the published traces.

    Request         one request: timestamp (ms), input_length,
                    output_length, hash_ids (Mooncake's keys, ``as_json()``)
    GenParams       the knobs (defaults: calibrated, see below)
    calibrate()     the share of single-turn sessions that gives
                    ``single_use`` (bisection)
    generate()      the requests, in arrival order
    trace_stats()   single-use share, reuse distances (in requests), chain
                    lengths of any trace
    read_trace()    a Mooncake JSON-lines file
    write_trace()   the same format

Calibration (defaults): Mooncake's conversation_trace.jsonl
(kvcache-ai/Mooncake, FAST25-release/traces; an hour of a chat service:
12,031 requests, 182,790 unique 512-token blocks, 75.8% of them used once,
chains of median 14 and mean 24 blocks, reuse distance in requests p25 189,
p50 384, p75 894, p90 1748). The defaults aim at those figures at 3.4
requests/s; ``trace_stats`` of both is in docs/guide/trace-bench.md.

Deterministic: every session draws from its own generator, seeded by
``(seed, session)``, so changing the single-turn share changes which sessions
are single-turn and nothing else (the bisection sees a monotone share).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
MAX_TOKENS = 128 * 1024


@dataclass(frozen=True)
class Request:
    """One request of a trace, Mooncake's fields (timestamp in ms)."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def as_json(self) -> str:
        return json.dumps({**asdict(self), "hash_ids": list(self.hash_ids)})


@dataclass(frozen=True)
class GenParams:
    """The generator's knobs.

    requests, rate          how many requests, arriving at ``rate`` per second
                            on average (sessions start as a Poisson process)
    single_use              the share of unique blocks used by one request
                            only, reached by bisection on the share of
                            single-turn sessions (None: use ``single_turn``)
    single_turn             the share of sessions of one request
    agent_share             the share of multi-turn sessions that are agent
                            loops (many turns, short gaps, tool outputs)
    turns, agent_turns      mean turns of a multi-turn conversation / loop
                            (at least 2: 2 + geometric)
    gap_s, agent_gap_s      median seconds between a session's turns
                            (lognormal): with ``rate``, the reuse distance
    first_tokens            median tokens of a session's first prompt
    message_tokens          median tokens a turn adds (answer + message)
    sigma                   the lognormals' spread
    seed
    """

    requests: int = 12_000
    rate: float = 3.4
    single_use: float | None = 0.76
    single_turn: float = 0.5
    agent_share: float = 0.1
    turns: float = 2.5
    agent_turns: float = 10.0
    gap_s: float = 220.0
    agent_gap_s: float = 120.0
    first_tokens: float = 6000.0
    message_tokens: float = 700.0
    sigma: float = 1.0
    seed: int = 39


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _geometric(rng: random.Random, mean: float) -> int:
    """0, 1, 2, ... with the given mean."""
    if mean <= 0:
        return 0
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def _session(
    p: GenParams, index: int, start_s: float, next_id: list[int]
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """One session's requests: (time s, input tokens, output tokens, chain).
    ``next_id`` holds the next free block id (shared by all sessions)."""
    rng = random.Random(p.seed * 1_000_003 + index)
    kind = rng.random()  # drawn first, always: the bisection moves only this
    agent = rng.random() < p.agent_share
    if kind < p.single_turn:
        turns = 1
    elif agent:
        turns = 2 + _geometric(rng, p.agent_turns - 2)
    else:
        turns = 2 + _geometric(rng, p.turns - 2)
    gap = p.agent_gap_s if agent else p.gap_s
    tokens = BLOCK_TOKENS + int(_lognormal(rng, p.first_tokens, p.sigma))
    blocks: list[int] = [0]  # the system prompt: every request's first block
    out = []
    at = start_s
    for turn in range(turns):
        tokens = min(tokens, MAX_TOKENS)
        full = tokens // BLOCK_TOKENS
        while len(blocks) < full:
            blocks.append(next_id[0])
            next_id[0] += 1
        chain = blocks[:full]
        if tokens % BLOCK_TOKENS:  # the partial tail: this prompt's alone
            chain = [*chain, next_id[0]]
            next_id[0] += 1
        answer = max(1, int(_lognormal(rng, 300.0, 0.8)))
        out.append((at, tokens, answer, tuple(chain)))
        if turn + 1 < turns:
            at += _lognormal(rng, gap, p.sigma)
            tokens += answer + int(_lognormal(rng, p.message_tokens, p.sigma))
    return out


def _generate(p: GenParams) -> list[Request]:
    """``p.requests`` requests at ``p.single_turn`` (no bisection)."""
    mean_turns = p.single_turn + (1 - p.single_turn) * (
        p.agent_share * max(p.agent_turns, 2) + (1 - p.agent_share) * max(p.turns, 2)
    )
    session_rate = p.rate / mean_turns
    clock = random.Random(p.seed)
    next_id = [1]
    made: list[tuple[float, int, int, tuple[int, ...]]] = []
    start, index = 0.0, 0
    horizon = p.requests / p.rate
    while True:
        while start <= horizon:
            made.extend(_session(p, index, start, next_id))
            index += 1
            start += clock.expovariate(session_rate)
        made.sort(key=lambda r: r[0])
        if len(made) >= p.requests or not made:
            break
        horizon *= 1.25  # a session's later turns fall past the horizon
    made = made[: p.requests]
    # Sessions begun near the end have not sent their later turns: the
    # requests kept span more than requests / rate. Rescaled to the rate
    # asked for (the order, and so every reuse distance in requests, stays).
    span = made[-1][0] if made else 0.0
    scale = (len(made) / p.rate) / span if span > 0 else 1.0
    return [
        Request(int(at * scale * 1000), tokens, answer, chain)
        for at, tokens, answer, chain in made
    ]


def calibrate(p: GenParams) -> GenParams:
    """``p`` with ``single_turn`` set where ``p.single_use`` asks: bisected
    (12 steps) to the share whose trace's single-use share is nearest it;
    where no share reaches it, the nearest end (0 or 1). ``single_use``
    None: ``p`` as it is."""
    if p.single_use is None:
        return p
    low, high = 0.0, 1.0
    best: tuple[float, float] | None = None
    for _ in range(12):
        mid = (low + high) / 2
        trace = _generate(replace(p, single_turn=mid))
        share = single_use_share(r.hash_ids for r in trace)
        if best is None or abs(share - p.single_use) < best[0]:
            best = (abs(share - p.single_use), mid)
        if share < p.single_use:
            low = mid
        else:
            high = mid
    assert best is not None
    return replace(p, single_turn=best[1])


def generate(p: GenParams) -> list[Request]:
    """The trace of ``calibrate(p)``."""
    return _generate(calibrate(p))


def single_use_share(chains: Iterable[Sequence[int]]) -> float:
    """The share of unique blocks that exactly one request uses."""
    counts: Counter[int] = Counter()
    for chain in chains:
        counts.update(set(chain))
    if not counts:
        return 0.0
    return sum(1 for c in counts.values() if c == 1) / len(counts)


def _quantile(ordered: Sequence[int], q: float) -> int:
    return ordered[int(q * (len(ordered) - 1))] if ordered else 0


def trace_stats(chains: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Requests, blocks, unique blocks, single-use share, chain length median
    and mean, and reuse distances (requests since the block's last use; p25,
    p50, p75, p90) of a trace."""
    last: dict[int, int] = {}
    distances: list[int] = []
    for i, chain in enumerate(chains):
        for block in chain:
            if block in last:
                distances.append(i - last[block])
            last[block] = i
    distances.sort()
    lengths = sorted(len(c) for c in chains)
    blocks = sum(lengths)
    return {
        "requests": len(chains),
        "blocks": blocks,
        "unique_blocks": len(last),
        "single_use_share": single_use_share(chains),
        "chain_median": _quantile(lengths, 0.5),
        "chain_mean": blocks / len(chains) if chains else 0.0,
        "reuse_distance": {
            f"p{int(q * 100)}": _quantile(distances, q) for q in (0.25, 0.5, 0.75, 0.9)
        },
    }


def read_trace(path: str | Path) -> list[Request]:
    """A Mooncake trace: one JSON object a line with ``timestamp``,
    ``input_length``, ``output_length``, ``hash_ids``. ValueError naming the
    line where one is not."""
    out = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(
                    Request(
                        int(row.get("timestamp", 0)),
                        int(row.get("input_length", 0)),
                        int(row.get("output_length", 0)),
                        tuple(int(h) for h in row["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{number}: found {line[:80]!r}, expected a JSON object "
                    f"with hash_ids (a list of ints), timestamp, input_length, "
                    f"output_length ({exc})"
                ) from None
    return out


def write_trace(path: str | Path, trace: Iterable[Request]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for request in trace:
            handle.write(request.as_json() + "\n")
