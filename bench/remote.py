"""Benchmark the remote tier (Mooncake) against raw Mooncake calls, and in vLLM.

The remote tier is Mooncake Store behind the local store; its baselines are
raw Mooncake calls on the same bytes, and in vLLM (CPU) a remote hit's TTFT.

Why: the tier is worth having only if loading a block from it costs about what
Mooncake itself costs (our verification and the copy into KV pages must not
eat its bandwidth), if write-through keeps up with a raw put, if the
scheduler's question "how far does this chain go on remotely" costs a fraction
of a step, and if a dead master never stalls a step beyond its budget.

One run, every part with its baseline measured in the same run, against a
``mooncake_master`` started here on free loopback ports (protocol tcp;
bench/harness/mooncake.py, the tests' master too):

  load      a contributor process (its own Python process and segment) writes
            ``--blocks`` blocks of the demo model's geometry (8 layers, 8 KV
            heads x 64 dims, 32-token blocks, fp32: 128 KiB a layer, 1 MiB a
            block) through the real write path: KVStore.put_async with the
            tier attached, i.e. the writer publishes each batch on disk, then
            AsyncSaver._offer_remote -> MooncakeTier.offer_blocks puts it from
            the ring. This process (segment 0: every byte crosses tcp) then
            reads all of them per round, the order alternating per round:
              raw    batch_get_into of the same keys and sizes into one
                     registered buffer (its own MooncakeDistributedStore client)
              ours   RemoteLoads.load into CPU KV pages (vLLM's CPU layout),
                     i.e. tier.fetch (get + verify) then the page copy
                     (remote_promote off: a load, not a save)
              fetch  MooncakeTier.fetch alone (get + verify, no copy)
              raw_tier  batch_get_into through the tier's own client into
                     the load buffer (a cross-check of the raw baseline)
            and, on the fetched bytes, the tier's verification alone
            (MooncakeTier._verify) and the page copy alone (RemoteLoads._copy):
            the split of ours into get/verify/copy.
            ``remote_load_ratio`` = median raw GB/s / median fetch GB/s: our
            load into host memory, verified, against raw batch_get_into into
            host memory; ``remote_load_to_pages_ratio`` the same with ours,
            which adds the copy into vLLM's CPU KV pages (raw being the faster
            of raw and raw_tier; GB/s: value bytes / wall time; a value is one
            block, header included).
  put       per round, fresh keys: ``--blocks`` blocks pre-staged in this
            process's staging ring as chunk images (begin_save, checksums
            filled as the writer fills them), offered in batches of
            ``--put-batch`` blocks (one chunk each, as the connector saves);
            ours = the bytes stored (the tier's remote_put_bytes delta) over
            the time from the first offer_blocks to drain() returning (the put
            thread's whole work: the values laid out whole in its registered
            staging buffer, one native copy out of the ring, then one
            batch_put_from per batch). raw = batch_put_from of the same
            number of values of the same size from one registered buffer, in
            the same batches, under fresh names, through the separate client
            and (raw_tier) the tier's own. ``remote_put_ratio`` = median ours
            GB/s / median GB/s of the faster raw. For reference the
            contributor's end-to-end write-through (put_async -> flush, the
            local disk publish included) is reported too.
  lookup    a 256-key chain the tier holds (written by the contributor
            through the same path, small blocks: presence is what counts) and
            this process's local store misses: each sample is
            KVStore.lookup(keys) then RemoteLookup.extend over the same keys
            (budget 50 ms, new_step() between samples), the tier's positive
            cache cleared first so that each is a real batch_is_exist round
            trip. ``lookup256_remote_us_p50``/``_p99`` over the samples; raw
            batch_is_exist of the same 256 names for reference.
  down      remote_timeout_ms = 20: the contributor is told to exit, the
            master is SIGKILLed, then for ~3 s scheduler steps are simulated
            (new_step(), then 4 extend() calls on fresh 8-key chains, a 5 ms
            pause); each step's time in extend is recorded from the first step
            after the kill (the window before the breaker opens included).
            ``max_scheduler_stall_ms_master_down`` = the longest step;
            ``stall_within_timeout``: it is <= remote_timeout_ms + 2 ms (the
            allowance for the step's own bookkeeping on a shared host such as vm).
  vllm      (``--no-vllm`` skips it) the harness's tiny Llama, vLLM's prefix
            cache on (as in production), a fresh master: node A (connector,
            remote_store mooncake, its own cache_dir, 512 MiB segment) stores
            the prompts and stays alive (--pause-after-warmup gate files);
            once the master's key count stops growing, node B (empty
            cache_dir, segment 0) runs them with --ttft: remote hits; node C
            (a fresh process over B's cache_dir, which promotion filled):
            local hits; a run without connector: recompute. Every node first
            sends a warm-up prompt as long as the timed ones (A stores it too,
            so B's is a remote hit and C's a local one). ``ttft_ms_*``: median
            over prompts (5, --quick: 1,000 tokens, 4 layers, hidden 256;
            else 8 of 2,000 tokens, 8 layers, hidden 512) of
            generate(max_tokens=1).
            ``remote_hit_tokens_match``: B's greedy tokens equal the
            recompute run's, and B's external tokens of every prompt equal its
            full hit ((tokens - 1) // 32 * 32).

Run: ``python -m bench remote [--quick] [--no-vllm] [--json PATH] [--dir DIR]
[--blocks N] [--rounds N] [--put-batch N] [--dtype float32|bfloat16]``; the
JSON keys follow the report header (bench/report.py). Every child process and
master is killed on exit, on error too.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.mooncake import HOST, MooncakeMaster
from bench.harness.mooncake import secret_file as harness_secret_file
from bench.harness.processes import child_env, die_with_parent, python_module, reap
from bench.report import Report, gbps, pct, table

os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

#: the demo model's KV geometry (``python -m bench vllm``, full size)
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 64, 32
LOOKUP_KEYS = 256
SEED = 7
DOWN_TIMEOUT_MS = 20.0
DOWN_SLACK_MS = 2.0

# -- processes -------------------------------------------------------------------------

_CHILDREN: list[subprocess.Popen[bytes]] = []
_MASTERS: list[MooncakeMaster] = []


def spawn(cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
    """A child that dies with this process and is killed at exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent, **kw,
        )  # fmt: skip
    _CHILDREN.append(proc)
    return proc


def kill_all() -> None:
    for proc in _CHILDREN:
        reap(proc)
    for master in _MASTERS:
        master.stop()


atexit.register(kill_all)


def start_master(work: Path) -> MooncakeMaster:
    """A mooncake_master on free loopback ports, logging into ``work``,
    stopped at exit."""
    master = MooncakeMaster(work)
    _MASTERS.append(master)
    try:
        return master.start(timeout=15.0)
    except RuntimeError as exc:
        raise SystemExit(f"mooncake_master did not start: {exc}") from None


def wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float, log: Path):
    """Wait until ``path`` exists; SystemExit (with the log's tail) when
    ``proc`` exits or the time runs out first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited {proc.returncode}" if proc.poll() is not None else "timeout"
            tail = log.read_text(errors="replace")[-4000:]
            raise SystemExit(f"{log.stem}: {why} before {path.name}:\n{tail}")
        time.sleep(0.02)


# -- geometry --------------------------------------------------------------------------


def block_spec(dtype: str, model: str = "bench-remote") -> Any:
    """The namespace of a vLLM CPU worker of the demo model: one U8 part a
    layer (its [heads, block, 2 * head_dim] page)."""
    from npukv_store import LayerSpec, NamespaceSpec, PartSpec

    page = KV_HEADS * BLOCK * 2 * HEAD_DIM * (4 if dtype == "float32" else 2)
    layers = tuple(
        LayerSpec(
            f"model.layers.{i}.self_attn.attn", (PartSpec("page", "U8", (page,)),)
        )
        for i in range(LAYERS)
    )
    return NamespaceSpec(model=model, block_size=BLOCK, kv_dtype=dtype, layers=layers)


def lookup_spec() -> Any:
    """A namespace of small blocks for the lookup chain (presence is what a
    lookup asks; the bytes do not matter)."""
    from npukv_store import LayerSpec, NamespaceSpec, PartSpec

    layers = (
        LayerSpec("model.layers.0.self_attn.attn", (PartSpec("page", "U8", (256,)),)),
    )
    return NamespaceSpec(
        model="bench-remote-lookup", block_size=BLOCK, kv_dtype="U8", layers=layers
    )


def block_rows(spec: Any, count: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random rows ``[count, row_bytes]`` per tensor."""
    rng = np.random.default_rng(seed)
    return {
        f"{layer.name}.page": rng.integers(0, 256, (count, layer.row_bytes), np.uint8)
        for layer in spec.layers
    }


def chain(store: Any, count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return list(store.keys_for([rng.randrange(3, 2048) for _ in range(count * BLOCK)]))


def aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 4096, np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip : skip + nbytes]


def secret_file(work: Path) -> str:
    """The tier's secret, shared by every node of the run: its key names and
    value MACs are part of what is measured."""
    return harness_secret_file(work / "remote.secret")


def store_config(cache_dir: Path, master: str, segment: int, ring: int, **kw: Any):
    from npukv_store import StoreConfig

    return StoreConfig(
        cache_dir=str(cache_dir), ring_size=ring, remote_store="mooncake",
        mooncake_master=master, mooncake_segment_size=segment,
        remote_secret_file=secret_file(cache_dir.parent), **kw,
    )  # fmt: skip


def wait_up(tier: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not tier.up:
        if time.monotonic() > deadline:
            raise SystemExit(f"the remote tier did not come up ({tier.breaker.reason})")
        time.sleep(0.02)


# -- the contributor process -----------------------------------------------------------


def save_without_tier(
    work: Path, spec: Any, count: int, batch: int, ring: int
) -> float:
    """Seconds to publish the same blocks locally with no tier attached (the
    save path's baseline for write-through)."""
    from npukv_store import KVStore, StoreConfig

    config = StoreConfig(
        cache_dir=str(work / "contrib_cache_off"), capacity="4GiB", ring_size=ring
    )
    with KVStore(config, spec) as store:
        store.prepare_async()
        keys = chain(store, count, SEED)
        rows = block_rows(spec, count, SEED)
        began = time.perf_counter()
        for start in range(0, count, batch):
            part = {name: rows[name][start : start + batch] for name in rows}
            assert store.put_async(keys[start : start + batch], part).queued
        assert store.flush(120)
        return time.perf_counter() - began


def contributor(conf_path: str) -> int:
    """Write the blocks through the real write path, say so, wait for exit."""
    from npukv_store import KVStore
    from npukv_store.remote.tier import MooncakeTier

    conf = json.loads(Path(conf_path).read_text())
    work = Path(conf["work"])
    spec, small = block_spec(conf["dtype"]), lookup_spec()
    config = store_config(
        work / "contrib_cache", conf["master"], conf["segment"], conf["ring"]
    )
    count, batch = conf["blocks"], conf["batch"]
    save_off_s = save_without_tier(work, spec, count, batch, conf["ring"])
    tier = MooncakeTier(config)
    wait_up(tier)
    store = KVStore(config, spec)
    store.prepare_async()
    ring = store.ring_buffer()
    tier.register(ring.ctypes.data, ring.nbytes)
    store.attach_remote(tier)
    side = store.sibling(small)
    keys = chain(store, count, SEED)
    rows = block_rows(spec, count, SEED)
    began = time.perf_counter()
    for start in range(0, count, batch):
        part = {name: rows[name][start : start + batch] for name in rows}
        result = store.put_async(keys[start : start + batch], part)
        assert result.queued == len(keys[start : start + batch]), result
    assert store._saver().writer.flush(120), "the local write path did not drain"
    saved_s = time.perf_counter() - began  # published locally
    assert store.flush(120), "the write path did not drain"
    wrote_s = time.perf_counter() - began
    counters = tier.counters.snapshot()
    lookup_keys = chain(side, LOOKUP_KEYS, SEED + 1)
    side.put_async(lookup_keys, block_rows(small, LOOKUP_KEYS, SEED + 1))
    assert store.flush(60)
    facts = {
        "fingerprint": store.fingerprint.hex(),
        "keys": [k.hex() for k in keys],
        "lookup_fingerprint": side.fingerprint.hex(),
        "lookup_keys": [k.hex() for k in lookup_keys],
        "write_through_s": wrote_s,
        "save_local_s_tier_on": saved_s,
        "save_local_s_tier_off": save_off_s,
        "counters": counters,
    }
    (work / "contrib.json").write_text(json.dumps(facts))
    (work / "contrib.ready").touch()
    while not (work / "contrib.exit").exists():
        time.sleep(0.05)
    side.close()
    store.close()
    tier.close()
    os._exit(0)  # Mooncake's close runs on a daemon thread: do not wait for it


# -- parts 1-4: this process, segment 0 ------------------------------------------------


def raw_client(master: str, local_buffer: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(HOST, "P2PHANDSHAKE", 0, local_buffer, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"raw Mooncake client setup returned {rc}")
    return client


def cpu_pages(spec: Any, num_blocks: int, dtype: str) -> dict[str, Any]:
    """vLLM's CPU KV caches: one shared buffer, per layer [B, H, N, 2D] views."""
    import torch

    kind = torch.float32 if dtype == "float32" else torch.bfloat16
    numel = num_blocks * KV_HEADS * BLOCK * 2 * HEAD_DIM
    shared = torch.zeros(len(spec.layers) * numel, dtype=kind)
    return {
        layer.name: shared[i * numel : (i + 1) * numel].view(
            num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM
        )
        for i, layer in enumerate(spec.layers)
    }


class Missed(Exception):
    """The tier gave up on a load (its deadline passed; the breaker opened)."""


def measure_load(
    tier: Any,
    raw: Any,
    store: Any,
    spec: Any,
    keys: list[bytes],
    rounds: int,
    dtype: str,
) -> dict[str, Any]:
    import torch

    from npukv_store.connector.worker.pages import page_layout
    from npukv_store.connector.worker.remote_loads import RemoteLoads
    from npukv_store.device import get_backend
    from npukv_store.remote.value import ValueLayout, remote_keys, verify_value

    count = len(keys)
    layout = ValueLayout.for_spec(spec)
    size = layout.value_bytes
    fp = store.fingerprint
    names = remote_keys(fp, keys, tier.keys.name_key)
    caches = cpu_pages(spec, count, dtype)
    backend = get_backend("cpu")
    placed = [
        (0, pos, page_layout(layer.name, caches, count, layer.row_bytes))
        for pos, layer in enumerate(spec.layers)
    ]
    loads = RemoteLoads(tier, [store], placed, backend, backend.new_stream(), False)
    ids = list(range(count))
    raw_buf = aligned(count * size)
    assert raw.register_buffer(raw_buf.ctypes.data, raw_buf.nbytes) == 0
    ptrs = [raw_buf.ctypes.data + i * size for i in range(count)]
    misses: list[dict[str, Any]] = []  # loads the tier gave up on (deadline)

    def host() -> np.ndarray:
        """The load buffer (replaced by RemoteLoads after an abandoned get)."""
        return loads._buffer.ensure(count * size).reshape(count, -1)

    def raw_get() -> float:
        began = time.perf_counter()
        codes = raw.batch_get_into(names, ptrs, [size] * count)
        took = time.perf_counter() - began
        assert all(c == size for c in codes), sorted(set(codes))
        return took

    def ours() -> float:
        began = time.perf_counter()
        failed = loads.load([keys], [ids])
        took = time.perf_counter() - began
        if failed:
            raise Missed(f"{len(failed)} blocks failed to load in {took:.3f} s")
        return took

    def fetch() -> float:
        began = time.perf_counter()
        result = tier.fetch(fp, layout, keys, host())
        took = time.perf_counter() - began
        if not all(result.ok):
            raise Missed(f"fetch: {result.ok.count(False)} failed in {took:.3f} s")
        return took

    def verify() -> float:
        began = time.perf_counter()
        out = host()
        if hasattr(tier, "_verify"):  # the tier's own verification (2 threads)
            bad = [w for w in tier._verify(layout, fp, keys, out, [size] * count) if w]
        else:
            bad = [
                i for i in ids
                if verify_value(layout, fp, keys[i], out[i], mac_key=tier.keys.mac_key)
            ]  # fmt: skip
        took = time.perf_counter() - began
        assert not bad
        return took

    def copy() -> float:
        began = time.perf_counter()
        loads._copy(0, layout, host(), ids, ids)
        return time.perf_counter() - began

    client = tier._client  # the tier's own Mooncake client, as a cross-check

    def raw_tier_client() -> float:
        base = host().ctypes.data
        began = time.perf_counter()
        codes = client.batch_get_into(
            names, [base + i * size for i in ids], [size] * count
        )
        took = time.perf_counter() - began
        assert all(c == size for c in codes), sorted(set(codes))
        return took

    steps = {"raw": raw_get, "ours": ours, "fetch": fetch, "raw_tier": raw_tier_client}

    def attempt(name: str, phase: str) -> float:
        """One timed step; a load the tier gave up on (its deadline, the
        breaker then open) is recorded and tried again once the tier is up."""
        for _ in range(4):
            try:
                return steps[name]()
            except Missed as exc:
                misses.append({"phase": phase, "step": name, "why": str(exc)})
                wait_up(tier)
        raise SystemExit(f"{name}: the tier gave up on every try: {misses[-4:]}")

    for name in steps:  # warm-up: first touches, connections
        attempt(name, "warm-up")
    expect = block_rows(spec, count, SEED)
    pages_match = all(
        np.array_equal(caches[layer.name].view(torch.uint8).reshape(count, -1).numpy(),
                       expect[f"{layer.name}.page"])
        for layer in spec.layers
    )  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in (*steps, "verify", "copy")}
    for round_ in range(rounds):
        order = list(steps) if round_ % 2 == 0 else list(steps)[::-1]
        for name in order:
            times[name].append(attempt(name, f"round {round_}"))
        attempt("fetch", "untimed")  # verify and copy alone: on its bytes
        times["verify"].append(verify())
        times["copy"].append(copy())
    loads.close()
    nbytes = count * size
    med = {k: statistics.median(v) for k, v in times.items()}
    per_round = {k: [round(gbps(nbytes, s), 3) for s in v] for k, v in times.items()}
    # the baseline: the faster of the two raw gets (the second client of a
    # process measured a few % slower than the tier's own here)
    base = "raw" if med["raw"] <= med["raw_tier"] else "raw_tier"
    best = [min(a, b) for a, b in zip(times["raw"], times["raw_tier"], strict=True)]
    return {
        # the key: our load into host memory (batch_get_into into the
        # registered buffer, every value verified) against raw batch_get_into
        # of the same bytes into host memory; the copy on into vLLM's KV
        # pages (the device layer's H2D, a CPU memcpy here) is the next key
        "remote_load_ratio": round(med[base] / med["fetch"], 3),
        "remote_load_ratio_per_round": [
            round(r / o, 3) for r, o in zip(best, times["fetch"], strict=True)
        ],
        "remote_load_to_pages_ratio": round(med[base] / med["ours"], 3),
        "remote_load_to_pages_ratio_per_round": [
            round(r / o, 3) for r, o in zip(best, times["ours"], strict=True)
        ],
        "remote_load_ratio_vs_raw_client": round(med["raw"] / med["ours"], 3),
        "load_baseline": base,
        "baseline_get_gbps": round(gbps(nbytes, med[base]), 3),
        "remote_fetch_ratio": round(med[base] / med["fetch"], 3),
        "raw_get_gbps": round(gbps(nbytes, med["raw"]), 3),
        "ours_load_gbps": round(gbps(nbytes, med["ours"]), 3),
        "ours_fetch_gbps": round(gbps(nbytes, med["fetch"]), 3),
        "raw_get_tier_client_gbps": round(gbps(nbytes, med["raw_tier"]), 3),
        "load_gbps_per_round": per_round,
        "load_split_ms": {
            "raw_get": round(med["raw"] * 1e3, 2),
            "fetch_get_and_verify": round(med["fetch"] * 1e3, 2),
            "verify": round(med["verify"] * 1e3, 2),
            "copy": round(med["copy"] * 1e3, 2),
            "ours_load": round(med["ours"] * 1e3, 2),
            "raw_get_tier_client": round(med["raw_tier"] * 1e3, 2),
            "load_minus_fetch_and_copy": round(
                (med["ours"] - med["fetch"] - med["copy"]) * 1e3, 2
            ),
            "fetch_get_minus_raw": round(
                (med["fetch"] - med["verify"] - med["raw"]) * 1e3, 2
            ),
        },
        "verify_gbps": round(gbps(nbytes, med["verify"]), 3),
        "copy_gbps": round(gbps(nbytes, med["copy"]), 3),
        "load_bytes": nbytes,
        "load_pages_match": pages_match,
        "load_deadline_misses": misses,
        "_raw_buf": raw_buf,
    }


def measure_put(
    tier: Any, raw: Any, store: Any, spec: Any, count: int, batch: int, rounds: int,
    raw_buf: np.ndarray,
) -> dict[str, Any]:  # fmt: skip
    from npukv_store.remote.transfers import MAX_QUEUED_PUTS
    from npukv_store.remote.value import ValueLayout
    from npukv_store.store.write.staging import _fill_checksums, block_pieces

    layout = ValueLayout.for_spec(spec)
    size = layout.value_bytes
    fp = store.fingerprint
    ring = store.ring_buffer()
    tier.register(ring.ctypes.data, ring.nbytes)
    pool = np.random.default_rng(SEED + 2).integers(
        0, 256, count * spec.block_bytes, np.uint8
    )
    nonce = os.urandom(4).hex()
    times: dict[str, list[float]] = {}
    batches = [(s, min(s + batch, count)) for s in range(0, count, batch)]
    client = tier._client  # the tier's own Mooncake client
    tier.register(raw_buf.ctypes.data, raw_buf.nbytes)

    def stage() -> list[tuple[Any, list[list[tuple[int, int]]]]]:
        """Fresh keys' chunk images in the ring, as the writer leaves them."""
        staged = []
        for start, end in batches:
            keys = [os.urandom(16) for _ in range(start, end)]
            save = store.begin_save(keys)
            assert save is not None, "ring full"
            assert len(save.keys) == len(keys), "keys already stored"
            chunk = save.batch.layout
            nbytes = chunk.checksum_offset - chunk.data_start
            offset = start * spec.block_bytes
            save.image[chunk.data_start : chunk.checksum_offset] = pool[
                offset : offset + nbytes
            ]
            _fill_checksums(save.image, chunk)
            staged.append((save, block_pieces(save.image.ctypes.data, chunk)))
        return staged

    def ours() -> float:
        staged = stage()
        before = tier.counters.snapshot().get("remote_put_bytes", 0)
        began = time.perf_counter()
        for save, pieces in staged:
            while tier._queued_puts >= MAX_QUEUED_PUTS:  # it would drop more
                time.sleep(0.0002)
            tier.offer_blocks(spec, fp, save.keys, pieces, lambda: None)
        assert tier.drain(60)
        took = time.perf_counter() - began
        stored = tier.counters.snapshot().get("remote_put_bytes", 0) - before
        for save, _ in staged:
            store.abort_save(save)
        if stored != count * size:  # dropped: the tier was down
            raise Missed(f"stored {stored} of {count * size} bytes")
        return took

    def raw_put(round_: int) -> float:
        names = [f"bench/raw/{nonce}/{round_}/{i}" for i in range(count)]
        base = raw_buf.ctypes.data
        began = time.perf_counter()
        for start, end in batches:
            codes = raw.batch_put_from(
                names[start:end], [base + i * size for i in range(start, end)],
                [size] * (end - start),
            )  # fmt: skip
            assert all(c == 0 for c in codes), sorted(set(codes))
        return time.perf_counter() - began

    def raw_tier_put(round_: int) -> float:
        """raw_put through the tier's own client (a cross-check)."""
        names = [f"bench/rawt/{nonce}/{round_}/{i}" for i in range(count)]
        base = raw_buf.ctypes.data
        began = time.perf_counter()
        for start, end in batches:
            codes = client.batch_put_from(
                names[start:end], [base + i * size for i in range(start, end)],
                [size] * (end - start),
            )  # fmt: skip
            assert all(c == 0 for c in codes), sorted(set(codes))
        return time.perf_counter() - began

    steps = {
        "ours": lambda _r: ours(), "raw": raw_put, "raw_tier": raw_tier_put,
    }  # fmt: skip
    misses = []
    wait_up(tier)
    for round_ in range(rounds):
        order = list(steps) if round_ % 2 == 0 else list(steps)[::-1]
        for name in order:
            for _ in range(4):
                try:
                    times.setdefault(name, []).append(steps[name](round_))
                    break
                except Missed as exc:
                    misses.append(f"round {round_} {name}: {exc}")
                    wait_up(tier)
            else:
                raise SystemExit(f"put {name}: the tier was down: {misses[-4:]}")
    nbytes = count * size
    med = {k: statistics.median(v) for k, v in times.items()}
    base = "raw" if med["raw"] <= med["raw_tier"] else "raw_tier"  # the faster
    best = [min(a, b) for a, b in zip(times["raw"], times["raw_tier"], strict=True)]
    return {
        "remote_put_ratio": round(med[base] / med["ours"], 3),
        "remote_put_ratio_per_round": [
            round(b / a, 3) for a, b in zip(times["ours"], best, strict=True)
        ],
        "remote_put_ratio_vs_raw_client": round(med["raw"] / med["ours"], 3),
        "put_baseline": base,
        "baseline_put_gbps": round(gbps(nbytes, med[base]), 3),
        "raw_put_tier_client_gbps": round(gbps(nbytes, med["raw_tier"]), 3),
        "raw_put_gbps": round(gbps(nbytes, med["raw"]), 3),
        "ours_put_gbps": round(gbps(nbytes, med["ours"]), 3),
        "put_gbps_per_round": {
            k: [round(gbps(nbytes, s), 3) for s in v] for k, v in times.items()
        },
        "put_bytes_per_round": nbytes,
        "put_misses": misses,
        "put_batch_blocks": batch,
    }


def measure_lookup(
    tier: Any, raw: Any, store: Any, fp: bytes, keys: list[bytes], samples: int
) -> dict[str, Any]:
    from npukv_store.connector.scheduler.remote_lookup import RemoteLookup
    from npukv_store.remote.value import remote_keys

    lookup = RemoteLookup(tier, 50.0)
    total, local, raw_us = [], [], []
    names = remote_keys(fp, keys, tier.keys.name_key)
    misses = 0
    wait_up(tier)
    for i in range(samples + 5):
        lookup.new_step()
        tier._present.clear()
        began = time.perf_counter()
        hit = store.lookup(keys)
        mid = time.perf_counter()
        found = lookup.extend(f"r{i}", [(fp, keys[hit:])])
        end = time.perf_counter()
        assert hit == 0, hit
        if found != len(keys):  # not answered in time, or the tier is down
            misses += 1
            wait_up(tier)
            time.sleep(0.1)
            tier._pending.clear()  # its late answer would time the next one
            continue
        began_raw = time.perf_counter()
        codes = raw.batch_is_exist(names)
        raw_took = time.perf_counter() - began_raw
        assert all(c == 1 for c in codes)
        if i >= 5:  # the first few warm the threads up
            total.append((end - began) * 1e6)
            local.append((mid - began) * 1e6)
            raw_us.append(raw_took * 1e6)
    return {
        "lookup256_remote_us_p50": round(statistics.median(total), 1),
        "lookup256_remote_us_p99": round(pct(total, 0.99), 1),
        "lookup256_local_miss_us_p50": round(statistics.median(local), 1),
        "lookup256_raw_is_exist_us_p50": round(statistics.median(raw_us), 1),
        "lookup256_raw_is_exist_us_p99": round(pct(raw_us, 0.99), 1),
        "lookup_samples": len(total),
        "lookup_misses": misses,
    }


def measure_down(
    tier: Any, master: MooncakeMaster, fp: bytes, seconds: float
) -> dict[str, Any]:
    from npukv_store.connector.scheduler.remote_lookup import RemoteLookup

    lookup = RemoteLookup(tier, DOWN_TIMEOUT_MS)
    wait_up(tier)

    def step(index: int) -> tuple[float, list[int | None]]:
        lookup.new_step()
        began = time.perf_counter()
        answers = [
            lookup.extend(f"d{index}.{j}", [(fp, [os.urandom(16) for _ in range(8)])])
            for j in range(4)
        ]
        return time.perf_counter() - began, answers

    up_ms = max(step(-i)[0] for i in range(1, 6)) * 1e3  # master still up
    master.kill()
    killed = time.perf_counter()
    steps: list[tuple[float, float, str]] = []  # (since kill, step s, answers)
    opened_at = None
    index = 0
    while time.perf_counter() - killed < seconds:
        took, answers = step(index)
        since = time.perf_counter() - killed
        if opened_at is None and not tier.breaker.up:
            opened_at = since
        steps.append(
            (since, took, ",".join("n" if a is None else str(a) for a in answers))
        )
        index += 1
        time.sleep(0.005)
    worst = max(steps, key=lambda s: s[1])
    max_ms = worst[1] * 1e3
    step_ms = [s[1] * 1e3 for s in steps]
    return {
        "remote_timeout_ms": DOWN_TIMEOUT_MS,
        "max_scheduler_stall_ms_master_down": round(max_ms, 2),
        "stall_within_timeout": max_ms <= DOWN_TIMEOUT_MS + DOWN_SLACK_MS,
        "stall_slack_ms": DOWN_SLACK_MS,
        "down_step_ms_p50": round(statistics.median(step_ms), 3),
        "down_steps": len(steps),
        "down_worst_step_at_s": round(worst[0], 3),
        "down_steps_over_1ms": sum(1 for s in step_ms if s > 1),
        "down_breaker_open_after_s": None if opened_at is None else round(opened_at, 3),
        "down_first_steps": [
            {"at_s": round(a, 4), "ms": round(t * 1e3, 3), "answers": ans}
            for a, t, ans in steps[:12]
        ],
        "up_step_max_ms": round(up_ms, 3),
    }


def remote_parts(
    args: argparse.Namespace, work: Path, sizes: dict[str, Any]
) -> dict[str, Any]:
    from npukv_store import KVStore
    from npukv_store.remote.client import mooncake_missing
    from npukv_store.remote.tier import MooncakeTier

    missing = mooncake_missing()
    if missing:
        raise SystemExit(missing)
    spec = block_spec(args.dtype)
    from npukv_store.remote.value import ValueLayout

    size = ValueLayout.for_spec(spec).value_bytes
    count, rounds = sizes["blocks"], sizes["rounds"]
    put_bytes = count * size * 3 * sizes["put_rounds"]
    segment = int((count * size + put_bytes) * 1.25) + (64 << 20)
    segment = (segment + (1 << 20) - 1) >> 20 << 20
    ring = ((2 * count * size) >> 20 << 20) + (32 << 20)
    sizes.update(value_bytes=size, contributor_segment_bytes=segment, ring_bytes=ring)
    master = start_master(work)
    conf = {
        "work": str(work), "master": master.address, "segment": segment,
        "ring": ring, "blocks": count, "batch": args.put_batch, "dtype": args.dtype,
    }  # fmt: skip
    (work / "contrib.conf.json").write_text(json.dumps(conf))
    log = work / "contributor.log"
    contrib = python_module(
        "bench", "remote", "--contributor", str(work / "contrib.conf.json")
    )
    child = spawn(contrib, log, env=child_env())
    config = store_config(work / "parent_cache", master.address, 0, ring)
    tier = MooncakeTier(config)
    raw = raw_client(master.address, config.mooncake_local_buffer)
    wait_up(tier)
    store = KVStore(config, spec)
    store.prepare_async()
    wait_file(work / "contrib.ready", child, 300, log)
    facts = json.loads((work / "contrib.json").read_text())
    assert facts["fingerprint"] == store.fingerprint.hex()
    keys = [bytes.fromhex(k) for k in facts["keys"]]
    written = facts["counters"].get("remote_put_bytes", 0)
    result: dict[str, Any] = {
        "write_through_e2e_gbps": round(gbps(written, facts["write_through_s"]), 3),
        "save_gbps_tier_off": round(gbps(written, facts["save_local_s_tier_off"]), 3),
        "save_gbps_tier_on": round(gbps(written, facts["save_local_s_tier_on"]), 3),
        "save_on_over_off": round(
            facts["save_local_s_tier_off"] / facts["save_local_s_tier_on"], 3
        ),
        "contributor_counters": facts["counters"],
    }
    print(f"contributor wrote {len(keys)} blocks of {size} B", flush=True)
    load = measure_load(tier, raw, store, spec, keys, rounds, args.dtype)
    raw_buf = load.pop("_raw_buf")
    result.update(load)
    print(f"load: ratio {load['remote_load_ratio']}", flush=True)
    result.update(
        measure_put(
            tier, raw, store, spec, count, args.put_batch, sizes["put_rounds"], raw_buf
        )
    )
    print(f"put: ratio {result['remote_put_ratio']}", flush=True)
    lfp = bytes.fromhex(facts["lookup_fingerprint"])
    lkeys = [bytes.fromhex(k) for k in facts["lookup_keys"]]
    result.update(measure_lookup(tier, raw, store, lfp, lkeys, sizes["lookup_samples"]))
    print(f"lookup: p50 {result['lookup256_remote_us_p50']} us", flush=True)
    result["tier_counters"] = tier.counters.snapshot()
    raw.close()  # before the master goes: ~1 s now, 7 s after
    (work / "contrib.exit").touch()
    try:
        child.wait(timeout=20)
    except subprocess.TimeoutExpired:
        reap(child)
    result.update(measure_down(tier, master, lfp, sizes["down_s"]))
    print(
        f"down: max step {result['max_scheduler_stall_ms_master_down']} ms", flush=True
    )
    store.close()
    tier.close()  # its Mooncake close (7 s: no master) runs on a daemon thread
    return result


# -- part 5: vLLM ----------------------------------------------------------------------


def vllm_part(
    args: argparse.Namespace, work: Path, sizes: dict[str, Any]
) -> dict[str, Any]:
    from bench.harness.vllm_run import BLOCK_SIZE, MODULE, ensure_model

    shape = (
        ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "4"]
        if args.quick
        else ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "8"]
    )
    model = work / "model"
    ensure_model(model, shape)
    tokens, num = sizes["prompt_tokens"], sizes["prompts"]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2048) for _ in range(tokens)] for _ in range(num)]
    (work / "prompts.json").write_text(json.dumps(prompts))
    full = (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    # a warm-up prompt as long as the timed ones: every node's first timed
    # request then finds its buffers grown and its forward shape built (B's
    # warm-up is a remote hit of the same size, C's a local one)
    warmup = tokens
    common = [
        "--model", str(model), "--prompts", str(work / "prompts.json"),
        "--max-model-len", str(max(4096, tokens + 64)), "--max-tokens", "8",
        "--warmup-tokens", str(warmup),
    ]  # fmt: skip
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    master = start_master(work)

    def extra(cache: str, segment: str) -> list[str]:
        config = {
            "cache_dir": str(work / cache), "ring_size": "128MiB",
            "remote_store": "mooncake", "mooncake_master": master.address,
            "mooncake_segment_size": segment,
            "remote_secret_file": secret_file(work),
        }  # fmt: skip
        return ["--connector", "npukv", "--extra", json.dumps(config)]

    def start(name: str, more: list[str]) -> subprocess.Popen[bytes]:
        cmd = python_module(MODULE, "run", "--out", str(work / f"{name}.json"))
        return spawn([*cmd, *common, *more], work / f"{name}.log", env=env)

    def finish(name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        try:
            rc = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            reap(proc)
            rc = -9
        if rc != 0:
            tail = (work / f"{name}.log").read_text(errors="replace")[-4000:]
            raise SystemExit(f"vLLM run {name} failed (rc {rc}):\n{tail}")
        report: dict[str, Any] = json.loads((work / f"{name}.json").read_text())
        return report

    began = time.perf_counter()
    gate = work / "gate_a"
    gate.mkdir()
    (gate / "go").touch()  # A runs its prompts at once, then waits at done/exit
    node_a = start(
        "node_a", [*extra("cache_a", "512MiB"), "--pause-after-warmup", str(gate)]
    )
    try:
        wait_file(gate / "done", node_a, 900, work / "node_a.log")
        keys_in: int | None = None
        stable_since, last = time.monotonic(), keys_in
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # A's puts are asynchronous
            keys_in = None
            with contextlib.suppress(OSError):  # not answering this time
                keys_in = master.key_count()
            if keys_in != last:
                last, stable_since = keys_in, time.monotonic()
            elif keys_in and time.monotonic() - stable_since > 1.5:
                break
            time.sleep(0.1)
        b = finish("node_b", start("node_b", [*extra("cache_b", "0"), "--ttft"]))
        c = finish("node_c", start("node_c", [*extra("cache_b", "0"), "--ttft"]))
    finally:
        (gate / "exit").touch()
    recompute = finish("recompute", start("recompute", ["--ttft"]))
    try:
        node_a.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reap(node_a)
    master.kill()

    def ttft_ms(report: dict[str, Any]) -> float:
        return round(statistics.median(r["ttft_s"] for r in report["results"]) * 1e3, 2)

    def toks(report: dict[str, Any]) -> list[list[int]]:
        return [r["tokens"] for r in report["results"]]

    def ext(report: dict[str, Any]) -> list[int | None]:
        return [r["external_tokens"] for r in report["results"]]

    expected = [full] * num
    return {
        "ttft_ms_remote": ttft_ms(b),
        "ttft_ms_local": ttft_ms(c),
        "ttft_ms_recompute": ttft_ms(recompute),
        "ttft_remote_over_recompute": round(ttft_ms(b) / ttft_ms(recompute), 3),
        "ttft_remote_over_local": round(ttft_ms(b) / ttft_ms(c), 3),
        "ttft_ms_per_prompt": {
            name: [round(r["ttft_s"] * 1e3, 2) for r in rep["results"]]
            for name, rep in (("remote", b), ("local", c), ("recompute", recompute))
        },
        "ttft_ms_min": {
            name: round(min(r["ttft_s"] for r in rep["results"]) * 1e3, 2)
            for name, rep in (("remote", b), ("local", c), ("recompute", recompute))
        },
        # how long the engine thread waited for a CPU in the generate() call
        # right after each TTFT call (the harness times that one): other work
        # on a shared host (vm: 2 cores) shows up here
        "vllm_cpu_wait_ms_median": {
            name: round(statistics.median(r["cpu_wait_ms"] for r in rep["results"]), 1)
            for name, rep in (("remote", b), ("local", c), ("recompute", recompute))
        },
        "remote_hit_tokens_match": toks(b) == toks(recompute) and ext(b) == expected,
        "local_hit_tokens_match": toks(c) == toks(recompute) and ext(c) == expected,
        "external_tokens": {"remote": ext(b), "local": ext(c), "full_hit": full},
        "node_a_keys_in_master": keys_in,
        "vllm_model": " ".join(shape),
        "vllm_s": round(time.perf_counter() - began, 1),
    }


# -- output ----------------------------------------------------------------------------


def print_table(r: dict[str, Any]) -> None:
    s = r["sizes"]
    print(
        f"\nremote tier: {s['blocks']} blocks x {s['value_bytes']} B "
        f"({s['blocks'] * s['value_bytes'] / 2**20:.0f} MiB), {s['rounds']} load "
        f"rounds, {s['put_rounds']} put rounds, {r['cpus']} CPUs"
    )
    rows = [
        ("load, raw batch_get_into", f"{r['raw_get_gbps']:.3f} GB/s", "1.00"),
        ("load, raw via the tier's client", f"{r['raw_get_tier_client_gbps']:.3f} GB/s",
         f"{r['raw_get_tier_client_gbps'] / r['raw_get_gbps']:.2f}"),
        ("load, ours (fetch+verify+copy)", f"{r['ours_load_gbps']:.3f} GB/s",
         f"{r['ours_load_gbps'] / r['raw_get_gbps']:.2f}"),
        ("load, ours fetch only", f"{r['ours_fetch_gbps']:.3f} GB/s",
         f"{r['ours_fetch_gbps'] / r['raw_get_gbps']:.2f}"),
        ("put, raw batch_put_from", f"{r['raw_put_gbps']:.3f} GB/s", "1.00"),
        ("put, raw via the tier's client",
         f"{r['raw_put_tier_client_gbps']:.3f} GB/s",
         f"{r['raw_put_tier_client_gbps'] / r['raw_put_gbps']:.2f}"),
        ("put, ours offer -> drain", f"{r['ours_put_gbps']:.3f} GB/s",
         f"{r['ours_put_gbps'] / r['raw_put_gbps']:.2f}"),
        ("write-through e2e (put_async->flush)",
         f"{r['write_through_e2e_gbps']:.3f} GB/s", ""),
        ("local save, tier off", f"{r['save_gbps_tier_off']:.3f} GB/s", "1.00"),
        ("local save, tier on (write-through)",
         f"{r['save_gbps_tier_on']:.3f} GB/s", f"{r['save_on_over_off']:.2f}"),
        ("lookup 256, local miss + remote p50",
         f"{r['lookup256_remote_us_p50']:.0f} us", ""),
        ("lookup 256, p99", f"{r['lookup256_remote_us_p99']:.0f} us", ""),
        ("lookup 256, raw batch_is_exist p50",
         f"{r['lookup256_raw_is_exist_us_p50']:.0f} us", ""),
        ("master down: longest step",
         f"{r['max_scheduler_stall_ms_master_down']:.2f} ms",
         f"<= {r['remote_timeout_ms']:.0f}: {r['stall_within_timeout']}"),
    ]  # fmt: skip
    if "ttft_ms_remote" in r:
        rows += [
            ("TTFT recompute", f"{r['ttft_ms_recompute']:.1f} ms", "1.00"),
            ("TTFT remote hit", f"{r['ttft_ms_remote']:.1f} ms",
             f"{r['ttft_remote_over_recompute']:.2f}"),
            ("TTFT local hit", f"{r['ttft_ms_local']:.1f} ms",
             f"{r['ttft_ms_local'] / r['ttft_ms_recompute']:.2f}"),
        ]  # fmt: skip
    print(table(["case", "value", "ratio"], rows))
    print(
        f"remote_load_ratio {r['remote_load_ratio']} (vs {r['load_baseline']}; "
        f"to the pages {r['remote_load_to_pages_ratio']}), "
        f"remote_put_ratio {r['remote_put_ratio']} (vs {r['put_baseline']}): "
        "ours over the faster raw baseline"
    )
    print(f"load split (ms, median): {r['load_split_ms']}")
    if "ttft_ms_min" in r:
        print(
            f"TTFT min per kind {r['ttft_ms_min']} ms; engine CPU waits "
            f"(median prompt) {r['vllm_cpu_wait_ms_median']} ms"
        )
    if "remote_hit_tokens_match" in r:
        print(
            f"remote_hit_tokens_match {r['remote_hit_tokens_match']}  "
            f"local_hit_tokens_match {r['local_hit_tokens_match']}  "
            f"external {r['external_tokens']}"
        )
    print(f"elapsed {r['elapsed_s']} s")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-vllm", action="store_true", help="skip the TTFT part")
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument("--blocks", type=int, default=0, help="blocks per load/put")
    parser.add_argument("--rounds", type=int, default=0, help="load rounds")
    parser.add_argument("--put-batch", type=int, default=16, help="blocks per offer")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    # the contributor process this benchmark starts (it exits on its own)
    parser.add_argument("--contributor", default="", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> Report:
    """Every part (``--quick``: small sizes); leaves with os._exit once the
    report is written (Mooncake closes on daemon threads)."""
    if args.contributor:
        contributor(args.contributor)  # never returns
    report = Report(args)
    started = time.perf_counter()
    quick = args.quick
    sizes: dict[str, Any] = {
        "blocks": args.blocks or (32 if quick else 64),
        "rounds": args.rounds or (5 if quick else 15),
        "put_rounds": 3 if quick else 8,
        "put_batch": args.put_batch,
        "lookup_keys": LOOKUP_KEYS,
        "lookup_samples": 60 if quick else 300,
        "down_s": 3.0,
        "prompts": 5 if quick else 8,
        "prompt_tokens": 1000 if quick else 2000,
        "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "block_tokens": BLOCK, "dtype": args.dtype,
    }  # fmt: skip
    work = (
        Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_remote_"))
    )
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"platform": platform.platform()}
    try:
        from importlib.metadata import version

        with contextlib.suppress(Exception):
            result["mooncake"] = version("mooncake-transfer-engine-non-cuda")
        result.update(remote_parts(args, work, sizes))
        if not args.no_vllm:
            result.update(vllm_part(args, work, sizes))
    finally:
        kill_all()
    result["sizes"] = sizes
    result["definitions"] = DEFINITIONS
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    report.data = result
    print_table(report.json())
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    # the tier's Mooncake close is still running on a daemon thread against a
    # dead master (7 s); interpreter shutdown under it can crash: leave at once
    report.hard_exit = True
    return report


DEFINITIONS = {
    "remote_load_ratio": "median fetch GB/s (MooncakeTier.fetch: batch_get_into "
    "into the registered load buffer + every value verified) / median raw GB/s "
    "of the same keys and sizes into a registered buffer, raw being the faster "
    "(load_baseline) of a separate MooncakeDistributedStore client (raw) and "
    "the tier's own client (raw_tier); GB/s = value bytes / wall; per round: "
    "against that round's faster raw",
    "remote_load_to_pages_ratio": "the same with ours (RemoteLoads.load: fetch "
    "then the copy into CPU KV pages, which on a device is the H2D copy); "
    "_vs_raw_client: against the separate client only",
    "remote_fetch_ratio": "= remote_load_ratio (kept for older reports)",
    "save_gbps_tier_off": "the contributor's put_async -> flush of the same "
    "blocks with no tier attached (local publish only)",
    "save_gbps_tier_on": "the same with the tier attached, until the local "
    "publish (the writer's flush; the remote puts go on after it)",
    "save_on_over_off": "save_gbps_tier_on / save_gbps_tier_off: what "
    "write-through costs the local save path",
    "load_split_ms": "medians: raw get (both clients), fetch (get + verify), "
    "verify alone, page copy alone, ours load; fetch_get_minus_raw = fetch - "
    "verify - raw get (separate client); load_minus_fetch_and_copy: the rest",
    "remote_put_ratio": "median ours GB/s / median raw GB/s; ours: "
    "remote_put_bytes over first offer_blocks -> drain() of pre-staged ring "
    "batches (chunk images, checksums filled); raw: batch_put_from of as many "
    "values of the same size from one registered buffer in the same batches, "
    "the faster (put_baseline) of the separate client and the tier's own; "
    "fresh keys every round",
    "write_through_e2e_gbps": "the contributor's remote_put_bytes over put_async "
    "of every batch -> flush() (local disk publish included)",
    "lookup256_remote_us_p50": "KVStore.lookup (a local miss) + RemoteLookup.extend "
    "over a 256-key chain the tier holds, positive cache cleared: one "
    "batch_is_exist round trip each (p99 likewise)",
    "max_scheduler_stall_ms_master_down": "after SIGKILL of the master, for ~3 s: "
    "the longest simulated step's time in extend (4 calls on fresh chains), "
    "remote_timeout_ms 20",
    "stall_within_timeout": "max_scheduler_stall_ms_master_down <= "
    "remote_timeout_ms + stall_slack_ms",
    "ttft_ms_remote": "median over prompts of generate(max_tokens=1), node B: "
    "every full block a remote hit (values in node A's segment)",
    "ttft_ms_local": "the same, node C over B's cache_dir (promoted blocks)",
    "ttft_ms_recompute": "the same without connector",
    "remote_hit_tokens_match": "B's greedy tokens == recompute's and B's external "
    "tokens per prompt == its full hit",
}
