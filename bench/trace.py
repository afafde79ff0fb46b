"""Trace replay: KVStore's hit ratio and writes at a few percent of a trace's
unique blocks, against LRU, write-on-second-sight and Belady's OPT.

Why (issue 39): on a real node the tier holds a few percent of the unique
blocks its traffic brings, and at that size the policy decides most of the
hit ratio. This replays a prefix-sharing trace in Mooncake's format (JSON
lines with ``timestamp``, ``input_length``, ``output_length``, ``hash_ids``:
one id per 512-token block, a request's ids its prompt's chain) through
``KVStore`` itself, at several capacities given as fractions of the trace's
unique blocks, and simulates in the same run, at the same capacities in
blocks, an exact block-level LRU (every miss written), write-on-second-sight
(a block written only on its second miss) and Belady's OPT (offline,
prefix-closed, with bypass): bench/harness/trace_sim.py.

A request, as vLLM's connector serves it: ``lookup`` of its chain (the hit
length of its prefix), ``read`` of the hit blocks with every row's bytes
checked against its hash id's (a pure function of the id: a wrong byte fails
the run), then one ``put`` of the missing blocks after the hit (prefix-closed;
the blocks past capacity are not saved). A block is one store block of 512
bytes (one layer, parts k and v of 256 bytes): the replay measures the
policy, not the disk; capacity in bytes is the blocks' bytes plus the chunk
files' fixed overhead (measured at start: one 1- and one 2-block chunk) per
chunk, at the LRU simulation's mean blocks per save. ``resident`` is the
blocks the store held (mean over the second half, sampled) over the capacity
in blocks: how near the byte capacity came to the block one.

Workloads: ``--trace PATH`` (Mooncake publishes conversation_trace.jsonl and
synthetic_trace.jsonl under FAST25-release/traces in github.com/kvcache-ai/
Mooncake; nothing is downloaded here), else the generator of
bench/harness/trace_gen.py (multi-turn conversations and agent loops
calibrated to the conversation trace; ``--requests``, ``--rate``,
``--single-use``, ``--seed``). ``--quick``: 4,000 generated requests, under
two minutes. ``--procs N``: N processes on one directory, request i replayed
by process i mod N, each in order.

Replay pace: as fast as it goes (``--replay-rate 0``, the default) with
``--grace-s 0``: the store's ``evict_grace_s`` (no chunk used in the last
grace seconds is evicted; a save that finds only such chunks is refused)
would, at hundreds of requests a second, refuse most saves and measure the
grace rather than the policy. ``--grace-s 5 --replay-rate R`` measures those
refusals at R requests a second; every run reports them (``refused``: saves
and blocks refused for room).

Columns per capacity and policy (JSON ``capacities[].policies``): ``hit``
blocks hit / blocks requested; ``tok hit`` the tokens of those blocks /
prompt tokens; ``written`` blocks written / blocks requested (= bytes: blocks
are one size); ``/OPT`` hit over OPT's. Per capacity: ``store/LRU``
(``store_over_lru_sim``, the issue's target >= 0.97), refused saves, and
``stranded``: blocks of a request's chain, past its hit, that the store still
held (a child kept after its parent left: chunk-level LRU touches a parent's
chunk and a child's with one timestamp), counted per request before its save.

Run: ``python -m bench trace [--quick] [--json PATH] [--trace PATH]
[--capacities 0.01,0.02,...] [--procs N] [--grace-s S] [--replay-rate R]``.
A module named ``trace`` would shadow the standard library's where bench/
itself is on sys.path (``python bench/trace.py``): that entry is dropped
first (``python -m bench trace`` has the repository root there instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench.harness.trace_gen import (  # noqa: E402
    GenParams,
    calibrate,
    generate,
    read_trace,
    trace_stats,
)
from bench.harness.trace_sim import block_tokens, simulate  # noqa: E402
from bench.report import Report, ratio, table  # noqa: E402
from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec  # noqa: E402
from npukv_store.config import StoreConfig  # noqa: E402

PART_BYTES = 256
BLOCK_BYTES = 2 * PART_BYTES
LAYER = "trace.kv"
NAMES = (f"{LAYER}.k", f"{LAYER}.v")
SPEC = NamespaceSpec(
    model="bench-trace",
    block_size=512,
    kv_dtype="float16",
    layers=(
        LayerSpec(
            LAYER,
            (PartSpec("k", "U8", (PART_BYTES,)), PartSpec("v", "U8", (PART_BYTES,))),
        ),
    ),
)
POLICIES = ("store", "lru", "second_sight", "opt")
SIMULATED = POLICIES[1:]
TARGET_STORE_OVER_LRU = 0.97
SAMPLE_EVERY = 64  # requests between samples of the store's resident blocks

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_WORDS = np.arange(BLOCK_BYTES // 8, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="a Mooncake-format trace (default: generated)")
    parser.add_argument(
        "--capacities",
        default="0.01,0.02,0.05,0.10,0.25",
        help="capacities, fractions of the trace's unique blocks",
    )
    parser.add_argument("--procs", type=int, default=1, help="replaying processes")
    parser.add_argument("--requests", type=int, default=12_000, help="generated")
    parser.add_argument("--rate", type=float, default=3.4, help="generated req/s")
    parser.add_argument(
        "--single-use", type=float, default=0.76, help="generated single-use share"
    )
    parser.add_argument("--seed", type=int, default=39, help="generator seed")
    parser.add_argument(
        "--grace-s", type=float, default=0.0, help="the store's evict_grace_s"
    )
    parser.add_argument(
        "--replay-rate",
        type=float,
        default=0.0,
        help="requests/s of the replay (0: as fast as it goes)",
    )
    parser.add_argument(
        "--fsync", default="never", choices=("never", "chunk"), help="store fsync"
    )
    parser.add_argument("--dir", default=None, help="where the stores go")


# -- blocks -------------------------------------------------------------------


def payload(ids: Sequence[int]) -> dict[str, np.ndarray]:
    """The k and v rows of blocks ``ids``: splitmix64 of (id, word), a pure
    function of the hash id, so every read can be checked."""
    x = np.asarray(ids, dtype=np.uint64)[:, None] * _GOLDEN + _WORDS[None, :]
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x ^= x >> np.uint64(31)
    rows = x.view(np.uint8).reshape(len(ids), BLOCK_BYTES)
    return {
        NAMES[0]: np.ascontiguousarray(rows[:, :PART_BYTES]),
        NAMES[1]: np.ascontiguousarray(rows[:, PART_BYTES:]),
    }


def block_key(block: int) -> bytes:
    return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16).digest()


def chunk_bytes(root: str) -> tuple[int, int]:
    """(fixed bytes per chunk file, bytes per block) of this spec's chunks."""
    config = StoreConfig(cache_dir=root, capacity=1 << 30, fsync="never")
    with KVStore(config, SPEC) as store:
        sizes = []
        for n, base in ((1, 1 << 40), (2, 1 << 41)):
            ids = [base + i for i in range(n)]
            store.put([block_key(i) for i in ids], payload(ids))
            sizes.append(store.stats().total_bytes)
    one, two = sizes[0], sizes[1] - sizes[0]  # a 1-block and a 2-block chunk
    return 2 * one - two, two - one


# -- the store's replay ----------------------------------------------------------


def _replay(
    root: str,
    capacity_bytes: int,
    capacity_blocks: int,
    grace_s: float,
    fsync: str,
    trace: Sequence[tuple[tuple[int, ...], int]],
    worker: int,
    procs: int,
    replay_rate: float,
) -> dict[str, Any]:
    """Requests ``worker``, ``worker + procs``, ... of ``trace`` (chain, input
    tokens) through one KVStore handle; counts."""
    config = StoreConfig(
        cache_dir=root, capacity=capacity_bytes, fsync=fsync, evict_grace_s=grace_s
    )
    keys_of: dict[int, bytes] = {}
    c: dict[str, Any] = dict.fromkeys(
        (
            "requests", "requested_blocks", "hit_blocks", "requested_tokens",
            "hit_tokens", "written_blocks", "saves", "refused_saves",
            "refused_blocks", "skipped_blocks", "stranded_blocks",
            "stranded_requests", "read_misses", "verify_failures",
        ),
        0,
    )  # fmt: skip
    resident: list[int] = []
    start = time.perf_counter()
    with KVStore(config, SPEC) as store:
        for i in range(worker, len(trace), procs):
            if replay_rate > 0:
                wait = start + i / replay_rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            chain, length = trace[i]
            keys = []
            for block in chain:
                key = keys_of.get(block)
                if key is None:
                    key = keys_of[block] = block_key(block)
                keys.append(key)
            hit = store.lookup(keys)
            if hit:
                out = {name: np.empty((hit, PART_BYTES), np.uint8) for name in NAMES}
                ok = store.read(keys[:hit], out)
                want = payload(chain[:hit])
                for name in NAMES:
                    wrong = ~np.all(out[name] == want[name], axis=1)
                    c["verify_failures"] += int(np.count_nonzero(wrong & np.array(ok)))
                good = ok.index(False) if False in ok else hit
                c["read_misses"] += hit - good
                hit = good
            tokens = block_tokens(length, len(chain))
            c["requests"] += 1
            c["requested_blocks"] += len(chain)
            c["hit_blocks"] += hit
            c["requested_tokens"] += sum(tokens)
            c["hit_tokens"] += sum(tokens[:hit])
            if hit < len(chain):
                held = sum(loc is not None for loc in store.index.locate(keys[hit:]))
                c["stranded_blocks"] += held
                c["stranded_requests"] += held > 0
            limit = min(len(chain), capacity_blocks)
            if hit < limit:
                result = store.put(keys[hit:limit], payload(chain[hit:limit]))
                c["saves"] += 1
                c["written_blocks"] += result.stored
                c["skipped_blocks"] += result.skipped
                c["refused_blocks"] += result.rejected
                c["refused_saves"] += result.rejected > 0
            if i % SAMPLE_EVERY == worker and 2 * i >= len(trace):
                resident.append(store.stats().num_blocks)
        counters = store.stats().counters
    c["seconds"] = time.perf_counter() - start
    c["file_bytes_written"] = counters["put_bytes"]
    c["evicted_chunks"] = counters["evicted_chunks"]
    c["resident"] = resident
    return c


def _worker(queue: Any, *args: Any) -> None:
    queue.put(_replay(*args))


def replay(
    root: str,
    capacity_bytes: int,
    capacity_blocks: int,
    args: argparse.Namespace,
    trace: Sequence[tuple[tuple[int, ...], int]],
) -> dict[str, Any]:
    """The store's replay of ``trace``, in ``args.procs`` processes."""
    common = (root, capacity_bytes, capacity_blocks, args.grace_s, args.fsync, trace)
    if args.procs <= 1:
        return _replay(*common, 0, 1, args.replay_rate)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    begin = time.perf_counter()
    procs = [
        ctx.Process(
            target=_worker, args=(queue, *common, w, args.procs, args.replay_rate)
        )
        for w in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    parts = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a replaying process exited with {proc.exitcode}")
    total: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = (
                total.get(name, 0) + value
                if name != "resident"
                else [*total.get(name, []), *value]
            )
    total["seconds"] = time.perf_counter() - begin
    return total


# -- the run ------------------------------------------------------------------------


def _policy_row(
    hit: int, blocks: int, hit_tokens: int, tokens: int, written: int, opt_hit: int
) -> dict[str, float]:
    return {
        "hit_ratio": ratio(hit, blocks),
        "token_hit_ratio": ratio(hit_tokens, tokens),
        "bytes_written_ratio": ratio(written, blocks),
        "hit_over_opt": ratio(hit, opt_hit),
    }


def _load(args: argparse.Namespace) -> tuple[list[tuple[tuple[int, ...], int]], str]:
    if args.trace:
        requests = read_trace(args.trace)
        source = args.trace
    else:
        params = calibrate(
            GenParams(
                requests=4_000 if args.quick else args.requests,
                rate=args.rate,
                single_use=args.single_use,
                seed=args.seed,
            )
        )
        requests = generate(replace(params, single_use=None))
        source = f"generated: {params}"
    return [(r.hash_ids, r.input_length) for r in requests], source


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    begin = time.perf_counter()
    trace, source = _load(args)
    chains = [chain for chain, _ in trace]
    lengths = [length for _, length in trace]
    stats = trace_stats(chains)
    unique = stats["unique_blocks"]
    fractions = [float(f) for f in args.capacities.split(",") if f.strip()]
    print(
        f"trace: {source}\n  {stats['requests']} requests, {stats['blocks']} blocks, "
        f"{unique} unique, {stats['single_use_share']:.1%} used once, reuse "
        f"distance p50 {stats['reuse_distance']['p50']} requests"
    )
    base = tempfile.mkdtemp(prefix="bench_trace-", dir=args.dir or "/var/tmp")
    try:
        fixed, per_block = chunk_bytes(str(Path(base) / "probe"))
        results = []
        for fraction in fractions:
            cap = max(1, round(fraction * unique))
            sims = {p: simulate(p, chains, cap, lengths) for p in SIMULATED}
            per_save = max(sims["lru"].blocks_per_save, 1.0)
            cap_bytes = cap * per_block + fixed * math.ceil(cap / per_save)
            root = str(Path(base) / f"cap{fraction}")
            got = replay(root, cap_bytes, cap, args, trace)
            shutil.rmtree(root, ignore_errors=True)
            opt_hit = sims["opt"].hit_blocks
            policies = {
                "store": _policy_row(
                    got["hit_blocks"],
                    got["requested_blocks"],
                    got["hit_tokens"],
                    got["requested_tokens"],
                    got["written_blocks"],
                    opt_hit,
                ),  # fmt: skip
                **{
                    name: _policy_row(
                        r.hit_blocks,
                        r.requested_blocks,
                        r.hit_tokens,
                        r.requested_tokens,
                        r.written_blocks,
                        opt_hit,
                    )  # fmt: skip
                    for name, r in sims.items()
                },
            }
            policies["store"]["file_bytes_written_ratio"] = ratio(
                got["file_bytes_written"], got["requested_blocks"] * BLOCK_BYTES
            )
            resident = got["resident"]
            row = {
                "fraction": fraction,
                "capacity_blocks": cap,
                "capacity_bytes": cap_bytes,
                "policies": policies,
                "store_over_lru_sim": ratio(got["hit_blocks"], sims["lru"].hit_blocks),
                "saves": got["saves"],
                "refused_saves": got["refused_saves"],
                "refused_blocks": got["refused_blocks"],
                "stranded_blocks": got["stranded_blocks"],
                "stranded_requests": got["stranded_requests"],
                "evicted_chunks": got["evicted_chunks"],
                "read_misses": got["read_misses"],
                "verify_failures": got["verify_failures"],
                "resident_over_capacity": (
                    sum(resident) / len(resident) / cap if resident else 0.0
                ),
                "replay_s": got["seconds"],
                "requests_per_s": ratio(got["requests"], got["seconds"]),
            }
            results.append(row)
            print(
                f"  capacity {fraction:g}: store {policies['store']['hit_ratio']:.3f}"
                f" lru {policies['lru']['hit_ratio']:.3f} opt "
                f"{policies['opt']['hit_ratio']:.3f} ({got['seconds']:.1f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _print(results)
    failures = sum(r["verify_failures"] for r in results)
    if failures:
        print(f"FAILED: {failures} rows read back with wrong bytes")
        report.exit_code = 1
    report.data = {
        "source": source,
        "trace": stats,
        "procs": args.procs,
        "grace_s": args.grace_s,
        "replay_rate": args.replay_rate,
        "fsync": args.fsync,
        "block_bytes": BLOCK_BYTES,
        "chunk_fixed_bytes": fixed,
        "chunk_bytes_per_block": per_block,
        "target_store_over_lru_sim": TARGET_STORE_OVER_LRU,
        "capacities": results,
        "seconds": time.perf_counter() - begin,
    }
    return report


def _print(results: list[dict[str, Any]]) -> None:
    rows: list[Sequence[object]] = []
    for r in results:
        rows.append(
            (
                f"capacity {r['fraction']:g} of unique blocks ({r['capacity_blocks']} "
                f"blocks): store/LRU {r['store_over_lru_sim']:.3f}, refused "
                f"{r['refused_saves']}/{r['saves']} saves, stranded "
                f"{r['stranded_blocks']} blocks in {r['stranded_requests']} requests, "
                f"resident {r['resident_over_capacity']:.2f}, "
                f"{r['requests_per_s']:.0f} req/s",
            )
        )
        for name in POLICIES:
            p = r["policies"][name]
            rows.append(
                (
                    f"  {name}",
                    f"{p['hit_ratio']:.3f}",
                    f"{p['token_hit_ratio']:.3f}",
                    f"{p['bytes_written_ratio']:.3f}",
                    f"{p['hit_over_opt']:.3f}",
                )
            )
    print(table(("policy", "hit", "tok hit", "written", "/OPT"), rows))
