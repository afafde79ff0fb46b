"""Block keys: the cost of keying the chain, per 128k-token prompt.

Format 2 keys each block with keyed BLAKE2b-128 (npukv_store.hashing); this
measures it next to format 1's unkeyed xxh3-128 chain (the baseline, measured
in the same run, written here as it was) and next to a seeded xxh3 chain (a
64-bit seed: the cheapest keying, rejected because it is not a PRF and
structured collisions of xxh3 do not depend on the seed, xxHash#1127).
Median of ``--repeats`` runs of each, at 16- and 128-token blocks; the ratios
are over the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from bench.report import Report, ratio, table
from npukv_store.hashing import chain_hashes

TOKENS = 131072


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5, help="runs of each chain")


def _format1(raw: bytes, step: int, ns: bytes) -> list[bytes]:
    """Format 1's chain, unkeyed: h[i] = xxh3_128(h[i-1] || tokens)."""
    prev, keys = xxhash.xxh3_128_digest(ns), []
    for i in range(len(raw) // step):
        prev = xxhash.xxh3_128_digest(prev + raw[i * step : (i + 1) * step])
        keys.append(prev)
    return keys


def _seeded_xxh3(raw: bytes, step: int, ns: bytes, seed: int) -> list[bytes]:
    prev, keys = xxhash.xxh3_128_digest(ns, seed), []
    for i in range(len(raw) // step):
        prev = xxhash.xxh3_128_digest(prev + raw[i * step : (i + 1) * step], seed)
        keys.append(prev)
    return keys


def _median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    repeats = 3 if args.quick else args.repeats
    tokens = np.random.default_rng(0).integers(0, 150_000, TOKENS)
    raw = tokens.astype("<i4").tobytes()
    ns, key = bytes(16), bytes(range(32))
    rows, results = [], {}
    for block in (16, 128):
        step = block * 4
        base = _median_ms(lambda: _format1(raw, step, ns), repeats)  # noqa: B023
        seeded = _median_ms(lambda: _seeded_xxh3(raw, step, ns, 7), repeats)  # noqa: B023
        keyed = _median_ms(
            lambda: chain_hashes(tokens, block, ns, key=key),  # noqa: B023
            repeats,
        )
        results[str(block)] = {
            "xxh3_unkeyed_ms": base,
            "xxh3_seeded_ms": seeded,
            "blake2b_keyed_ms": keyed,
            "keyed_ratio": ratio(keyed[0], base[0]),
        }
        for name, (median, low, high) in (
            ("xxh3-128 unkeyed (format 1)", base),
            ("xxh3-128 seeded", seeded),
            ("BLAKE2b-128 keyed (format 2)", keyed),
        ):
            rows.append(
                (block, name, f"{median:.2f}", f"{low:.2f}-{high:.2f}",
                 f"{ratio(median, base[0]):.2f}")
            )  # fmt: skip
    print(f"chain keys of one {TOKENS}-token prompt, median of {repeats}")
    print(table(("block", "chain", "ms", "spread", "x format 1"), rows, "><>>>"))
    report.data = {"tokens": TOKENS, "repeats": repeats, "blocks": results}
    return report
