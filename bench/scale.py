"""Scale: how the store's costs grow with keys, chunks, processes and TP.

Every figure is a ratio or a growth exponent measured in one run (the VM's
absolute times are noisy; the growth is the point, issue 27):

  index     a 256-key chain lookup, an evicting commit and a claim at 10^4 ..
            10^7 keys (7 rows a chunk), warm and cold; index bytes per key
            (bench/scale_index.py)
  open      ``KVStore`` open at 10^3 .. 10^6 chunks, alone and as the last
            of 17 processes opening at once (bench/scale_open.py)
  maint     rebuild-index synced and not, ``npukv gc``, ``verify`` and
            ``compact`` in chunks per second (bench/scale_maint.py)
  match     ``SchedulerSide.match`` of a 128k-token prompt with 1, 4 and 16
            namespaces, first call and retry (bench/scale_match.py)
  mla       disk bytes when 4 workers load the same cold MLA hit
  host      a worker's peak RSS and /dev/shm at TP 4 and TP 16
            (bench/scale_host.py)

Indexes are bulk-built (bench/scale_fill.py); the open case's chunks are
index records without data files, the maintenance case's real tiny files.
``--quick`` (CI: about 30 s on 2 cores, in tests/harness) and ``--sizes tiny``
shrink the largest sizes; the JSON's ``sizes`` says which ran, and the ratio
keys keep their names (``sizes`` says what they compare). Run: ``python -m
bench scale [--quick] [--sizes full|quick|tiny] [--json PATH] [--dir PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench import scale_host, scale_index, scale_maint, scale_match, scale_open
from bench.report import Report, ratio, table


@dataclass(frozen=True)
class Sizes:
    keys: tuple[int, ...]  # index case
    index_calls: int
    cold_calls: int
    open_chunks: tuple[int, ...]  # open case; 17 at once at the largest
    open_processes: int
    open_repeats: int
    maint_chunks: int
    match_tokens: int
    match_repeats: int
    mla_gib: float
    mla_rounds: int
    batched_tokens: int  # max_num_batched_tokens the host case's rings follow


FULL = Sizes(
    (10**4, 10**5, 10**6, 10**7), 300, 50, (10**3, 10**4, 10**5, 10**6), 17, 3,
    2 * 10**4, 131072, 3, 1.0, 3, 16384,
)  # fmt: skip
QUICK = Sizes(
    (10**4, 10**5, 10**6), 150, 30, (10**3, 10**4), 17, 1,
    2 * 10**3, 131072, 2, 0.25, 1, 16384,
)  # fmt: skip
TINY = Sizes(
    (2 * 10**3, 2 * 10**4), 30, 10, (200, 2000), 17, 1,
    200, 16384, 1, 0.02, 1, 1024,
)  # fmt: skip
SIZES = {"full": FULL, "quick": QUICK, "tiny": TINY}
#: the environment's word on the sizes, for the tests (``--sizes`` wins)
SIZES_ENV = "NPUKV_BENCH_SCALE_SIZES"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", metavar="PATH", default="/var/tmp",
        help="parent of the temporary directories (default /var/tmp: a disk)",
    )  # fmt: skip
    parser.add_argument(
        "--sizes", choices=sorted(SIZES),
        help=f"full, quick (--quick; CI) or tiny (also ${SIZES_ENV})",
    )  # fmt: skip


def pick_sizes(args: argparse.Namespace) -> tuple[str, Sizes]:
    name = (
        args.sizes or os.environ.get(SIZES_ENV) or ("quick" if args.quick else "full")
    )
    return name, SIZES[name]


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    name, sizes = pick_sizes(args)
    root = tempfile.mkdtemp(prefix="bench_scale_", dir=args.dir)
    started = time.perf_counter()
    raw: dict[str, Any] = {}
    cases = {
        "index": lambda: scale_index.run_case(
            os.path.join(root, "index"), sizes.keys, sizes.index_calls,
            sizes.cold_calls,
        ),
        "open": lambda: scale_open.run_case(
            root, sizes.open_chunks, sizes.open_chunks[-1], sizes.open_processes,
            sizes.open_repeats,
        ),
        "maint": lambda: scale_maint.run_case(root, sizes.maint_chunks),
        "match": lambda: scale_match.run_case(
            os.path.join(root, "match"), sizes.match_repeats, sizes.match_tokens
        ),
        "mla": lambda: scale_host.mla_reads(root, sizes.mla_gib, sizes.mla_rounds),
        "host": lambda: scale_host.host_memory(root, sizes.batched_tokens),
    }  # fmt: skip
    case_s = {}
    try:
        for case, measure in cases.items():
            t0 = time.perf_counter()
            raw[case] = measure()
            case_s[case] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.data = {
        **figures(raw),
        "sizes": {
            "name": name,
            **asdict(sizes),
            "open_concurrent_chunks": sizes.open_chunks[-1],
        },
        "raw": raw,
        "case_s": case_s,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print_tables(report.data)
    return report


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    """The ratios and exponents, each from ``raw`` figures of this run."""
    rows = raw["index"]["rows"]
    first, last = rows[0], rows[-1]
    n = [r["keys"] for r in rows]

    def exponent(phase: str, op: str) -> float:
        return scale_index.growth_exponent(n, [r[phase][op] for r in rows])

    opens = raw["open"]["rows"]
    together = raw["open"]["concurrent"]
    maint = raw["maint"]
    match = raw["match"]["by_namespaces"]
    return {
        "lookup_growth_1e7_over_1e4": ratio(
            last["warm"]["lookup_us"], first["warm"]["lookup_us"]
        ),
        "evict_commit_growth_1e7_over_1e4": ratio(
            last["warm"]["evict_commit_us"], first["warm"]["evict_commit_us"]
        ),
        "evict_commit_pages_1e7_over_1e4": ratio(
            last["warm"]["evict_commit_pages"], first["warm"]["evict_commit_pages"]
        ),
        "commit_growth_1e7_over_1e4": ratio(
            last["warm"]["commit_us"], first["warm"]["commit_us"]
        ),
        "claim_growth_1e7_over_1e4": ratio(
            last["warm"]["claim_release_us"], first["warm"]["claim_release_us"]
        ),
        "cold_lookup_growth_1e7_over_1e4": ratio(
            last["cold"]["lookup_us"], first["cold"]["lookup_us"]
        ),
        "cold_lookup_over_warm_1e7": ratio(
            last["cold"]["lookup_us"], last["warm"]["lookup_us"]
        ),
        "growth_exponents": {
            f"{phase}_{op}": exponent(phase, op)
            for phase in ("warm", "cold")
            for op in ("lookup_us", "evict_commit_us", "claim_release_us")
        },
        "index_bytes_per_key": raw["index"]["index"]["in_use_bytes_per_key"],
        "open_growth_1e6_over_1e3": ratio(opens[-1]["alone_s"], opens[0]["alone_s"]),
        "open_last_of_17_over_alone": ratio(together["last_s"], together["alone_s"]),
        "open_last_of_17_over_cpu_bound": ratio(
            together["last_s"], together["cpu_bound_s"]
        ),
        "rebuild_sync_over_nosync": ratio(
            maint["rebuild_sync_s"], maint["rebuild_nosync_s"]
        ),
        "chunks_per_s": {
            k.removesuffix("_chunks_s"): v
            for k, v in maint.items()
            if k.endswith("_chunks_s")
        },
        "mla_disk_bytes_over_hit_bytes_4_workers": float(
            raw["mla"]["mla_disk_bytes_over_hit_bytes_4_workers"]
        ),
        "match_16ns_over_1ns": ratio(match["16"]["first_ms"], match["1"]["first_ms"]),
        "match_4ns_over_1ns": ratio(match["4"]["first_ms"], match["1"]["first_ms"]),
        "match_retry_lookups": match["16"]["retry_lookups"],
        "shm_bytes_per_process_tp16": raw["host"]["16"]["shm_bytes_per_process"],
        "peak_rss_bytes_per_process_tp16": raw["host"]["16"][
            "peak_rss_bytes_per_process"
        ],
    }


def print_tables(data: dict[str, Any]) -> None:
    raw, sizes = data["raw"], data["sizes"]
    rows: list[list[object]] = []
    for r in raw["index"]["rows"]:
        w, c = r["warm"], r["cold"]
        rows.append([
            f"{r['keys']:.0e} keys", f"{w['lookup_us']:.0f} / {c['lookup_us']:.0f}",
            f"{w['evict_commit_us']:.0f} / {c['evict_commit_us']:.0f}",
            f"{w['claim_release_us']:.0f} / {c['claim_release_us']:.0f}",
        ])  # fmt: skip
    print("index: p50 µs, warm / cold (the first calls after a page-cache drop)")
    print(table(("size", "lookup 256", "evicting commit", "claim+release"), rows))
    per_key, cold_by = data["index_bytes_per_key"], raw["index"]["cold_by"]
    print(f"index: {per_key:.1f} B/key in use; cold by {cold_by}\n")
    together = raw["open"]["concurrent"]
    rows = [
        [f"{r['chunks']:.0e} chunks", f"{r['alone_s'] * 1e3:.1f}"]
        for r in raw["open"]["rows"]
    ]
    rows.append([
        f"last of {together['processes']} at {together['chunks']:.0e}",
        f"{together['last_s'] * 1e3:.1f}",
    ])  # fmt: skip
    rows.append([
        f"CPU bound: {together['cpu_s'] * 1e3:.1f} ms CPU on {together['cpus']} cores",
        f"{together['cpu_bound_s'] * 1e3:.1f}",
    ])  # fmt: skip
    print(table(("open", "ms"), rows))
    m = raw["maint"]
    print()
    print(table(
        (f"maintenance, {m['chunks']} chunks", "chunks/s"),
        [[k, f"{v:.0f}"] for k, v in data["chunks_per_s"].items()],
    ))  # fmt: skip
    print()
    rows = [
        [f"{v['namespaces']} ns", f"{v['first_ms']:.1f}", f"{v['retry_ms']:.2f}",
         v["retry_lookups"]]
        for v in raw["match"]["by_namespaces"].values()
    ]  # fmt: skip
    print(
        table(
            (
                f"match {raw['match']['tokens']} tokens",
                "first ms",
                "retry ms",
                "retry lookups",
            ),
            rows,
        )
    )
    print()
    rows = [
        [f"TP {h['tp']}", f"{h['peak_rss_bytes_per_process'] / 2**20:.0f}",
         f"{h['shm_bytes_per_process'] / 2**20:.0f}",
         f"{h['shm_bytes_per_engine'] / 2**30:.2f}"]
        for h in raw["host"].values()
    ]  # fmt: skip
    print(table(("worker", "peak RSS MiB", "/dev/shm MiB", "engine shm GiB"), rows))
    keys = [
        k
        for k in data
        if k.endswith(
            (
                "_over_1e4",
                "_over_1e3",
                "_over_alone",
                "_over_cpu_bound",
                "_over_nosync",
                "_workers",
                "_over_1ns",
            )
        )
    ]
    print()
    print(table(("figure", "value"), [[k, f"{data[k]:.3f}"] for k in keys] + [
        ["match_retry_lookups", data["match_retry_lookups"]],
        ["index_bytes_per_key", f"{data['index_bytes_per_key']:.1f}"],
    ]))  # fmt: skip
    print(
        f"sizes: {sizes['name']} (keys {sizes['keys']}, chunks "
        f"{sizes['open_chunks']}); wall {data['wall_s']} s"
    )
