"""Head to head on real vLLM: none, ExampleConnector, LMCache, npukv_store (and
vLLM's OffloadingConnector where there is a GPU): hit TTFT and what each does
on restart, over capacity, under kill -9 and with a corrupted file.

One run, one model, the same prompts. Per peer and per run (``--runs``,
default 3: medians, min and max): a store process (vLLM computes the prompts
and the peer saves their KV), then the page cache dropped (after a sync and a
pause, as bench/vllm_runs.py does) and a fresh load process (the cold hit),
then another fresh load process (the warm hit: the files in the page cache).
Every vLLM run is its own process, its engine in its own process too
(bench/harness/peers.py), ``PYTHONHASHSEED`` the same in all. TTFT is a
generate() of max_tokens=1 of a prompt that process has never seen (the median
over the prompts of a process); ``tokens_loaded`` is that request's
``num_cached_tokens`` (what the peer loaded: vLLM's own prefix cache is empty
for it); the tokens are 8 greedy tokens generated next, compared with the
``none`` row's (recompute).

LMCache is 0.5.6 in its multi-process server mode (the one that runs on vLLM's
CPU build), an fs L2 under its directory, chunk 64, a fresh server for every
load process (an empty L1: a hit comes from the files). It runs from
``.venv-lmcache`` (scripts/setup_lmcache.sh); without it the row says so.

The behaviour rows, run once (the first run), each pass, fail or skipped with
its reason:

  restart   the cold hit itself: a fresh process (and, for LMCache, a fresh
            server) loads the prompts' KV, tokens equal to none's.
  bounded   the smallest capacity each peer takes (npukv_store: ``capacity``
            of two prompts' KV; LMCache's fs L2 and ExampleConnector take
            none), then three times that written (6 new prompts): pass when
            the bytes on disk stay under twice the capacity (an unbounded
            store keeps all three times).
  kill9     a store process (with LMCache: and its server) killed with
            SIGKILL once the peer's directory has started to grow, then a
            fresh process on the same prompts: pass when it runs and its
            tokens equal none's.
  corrupt   the middle half of the peer's largest data file (a chunk file)
            overwritten in place (0x7f bytes: float32 3.4e38, KV that cannot
            go unnoticed in the tokens), then a fresh load process: pass when
            it runs and its tokens equal none's (the damaged KV was refused and
            recomputed, not used). Its ``num_cached_tokens`` is shown, not
            judged: vLLM counts what a connector claimed at scheduling, before
            a worker that finds the damage fails the load.

vLLM's OffloadingConnector, CPU tier and fs secondary tier, runs only where
``torch.cuda.is_available()``: on the CPU its worker refuses ("CPU Offloading
is currently only supported on CUDA-alike and XPU GPUs"). Its fs tier's file
I/O (``vllm/v1/kv_offload/tiering/fs/io.py``) needs no GPU and is driven
directly instead (``fs_tier`` in the JSON: restart, capacity, corruption).

``--quick``: bench/vllm_runs.py's quick model (4 layers, hidden 256, 4 KV
heads, fp32), 3 prompts of 1,000 tokens; the full form: 8 layers, hidden 512,
8 heads, 2 KV heads, 3 prompts of 2,000 tokens. Block 64 in both. Targets:
npukv_store's cold hit TTFT at most 0.6x LMCache's and at most 1.0x
ExampleConnector's, tokens equal to none's, its four behaviour rows pass.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import vllm_runs
from bench.harness import peers as hp
from bench.harness.vllm_run import ensure_model
from bench.report import Report, table

BLOCK = 64
PEERS = ("none", "example", "lmcache", "npukv", "offloading_cpu", "offloading_fs")
LABELS = {
    "none": "none (recompute)",
    "example": "vLLM ExampleConnector",
    "lmcache": "LMCache 0.5.6 MP (chunk 64)",
    "npukv": "npukv_store",
    "offloading_cpu": "vLLM OffloadingConnector CPU",
    "offloading_fs": "vLLM OffloadingConnector fs tier",
}
BEHAVIOURS = ("restart", "bounded", "kill9", "corrupt")
#: The targets: npukv's cold hit TTFT over each peer's, at most.
TARGETS = {"lmcache": 0.6, "example": 1.0}
NO_CUDA = (
    "skipped: no GPU here; the OffloadingConnector's worker refuses the CPU "
    '("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs")'
)


# -- the pure parts (tests/harness/test_peers.py) --------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max (ms, 2 decimals) of per-run values; all None if none."""
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "runs": [round(v, 2) for v in values],
    }


def ratios(ttft: dict[str, float | None], ours: str = "npukv") -> dict[str, Any]:
    """``ours_over_<peer>``: our TTFT over each other peer's (None where
    either was not measured)."""
    mine = ttft.get(ours)
    out: dict[str, Any] = {}
    for peer, value in ttft.items():
        if peer == ours:
            continue
        ok = mine is not None and value is not None and value > 0
        out[f"ours_over_{peer}"] = round(mine / value, 3) if ok else None  # type: ignore[operator]
    return out


def verdict(ok: bool | None, reason: str) -> dict[str, str]:
    """A behaviour row: pass, fail or skipped (ok None), with its reason."""
    status = "skipped" if ok is None else ("pass" if ok else "fail")
    return {"status": status, "reason": reason}


def bounded_verdict(disk: int, capacity: int | None, written: int) -> dict[str, str]:
    """Bytes on disk after ``written`` bytes of KV (3x the capacity) went in:
    bounded when under twice the capacity; no capacity is unbounded."""
    mib = 1 << 20
    if capacity is None:
        return verdict(
            False,
            f"no capacity setting: {disk / mib:.1f} MiB on disk after "
            f"{written / mib:.1f} MiB of KV written (unbounded)",
        )
    ok = disk < 2 * capacity
    return verdict(
        ok,
        f"{disk / mib:.1f} MiB on disk after {written / mib:.1f} MiB of KV "
        f"written, capacity {capacity / mib:.1f} MiB",
    )


def corrupt_verdict(
    report: dict[str, Any], none_tokens: list[list[int]], clean_loaded: int
) -> dict[str, str]:
    """Pass: the load process ran and its tokens equal none's. The damage
    (float32 3.4e38 over half a chunk's KV) cannot go unnoticed in the tokens
    where it is used, so equal tokens say it was not. ``loaded_tokens`` is
    vLLM's ``num_cached_tokens``: what the connector claimed at scheduling,
    before its worker found the damage and vLLM recomputed (a claim, shown,
    not judged)."""
    if "error" in report:
        return verdict(False, f"the load process failed ({report['error']})")
    claimed = loaded_of(report)
    if tokens_of(report) != none_tokens:
        return verdict(
            False,
            f"tokens differ from none's: the damaged KV was used ({claimed} of "
            f"{clean_loaded} tokens claimed)",
        )
    return verdict(
        True,
        f"tokens equal none's ({claimed} of {clean_loaded} tokens claimed at "
        "scheduling; what the worker refused, vLLM recomputed)",
    )


def tokens_of(report: dict[str, Any]) -> list[list[int]]:
    return [r["tokens"] for r in report.get("results", [])]


def loaded_of(report: dict[str, Any]) -> int:
    return int(sum(r["loaded_tokens"] for r in report.get("results", [])))


def psi_ms(report: dict[str, Any]) -> float | None:
    """The median over a process's prompts of how long some task of the
    machine waited for a CPU during the timed request (/proc/pressure/cpu):
    the other work on a shared machine, per row."""
    values = [r.get("psi_cpu_ms", 0.0) for r in report.get("results", [])]
    return statistics.median(values) if values else None


def ttft_ms(report: dict[str, Any]) -> float | None:
    """The median TTFT of a process's prompts, ms."""
    values = [r["ttft_s"] * 1e3 for r in report.get("results", [])]
    return statistics.median(values) if values else None


def targets(rows: dict[str, dict[str, Any]], ratio: dict[str, Any]) -> dict[str, Any]:
    """Each target: measured, limit, met (None where not measured)."""
    out: dict[str, Any] = {}
    for peer, limit in TARGETS.items():
        value = ratio.get(f"ours_over_{peer}")
        out[f"ttft_vs_{peer}"] = {
            "measured": value, "limit": limit,
            "met": None if value is None else value <= limit,
        }  # fmt: skip
    ours = rows.get("npukv", {})
    out["tokens_equal_none"] = {"met": ours.get("tokens_equal_none")}
    for name in BEHAVIOURS:
        status = ours.get(name, {}).get("status")
        out[name] = {"met": None if status in (None, "skipped") else status == "pass"}
    return out


# -- the runs --------------------------------------------------------------------------


@dataclass
class Setup:
    work: Path
    quick: bool
    prompt_tokens: int
    num_prompts: int
    shape: list[str]
    layers: int
    kv_heads: int
    head_dim: int
    settle_s: float
    prompts: Path = field(default_factory=Path)
    extra_prompts: Path = field(default_factory=Path)

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 4  # fp32

    @property
    def prompt_kv_bytes(self) -> int:
        return self.prompt_tokens // BLOCK * BLOCK * self.kv_bytes_per_token

    @property
    def warmup_tokens(self) -> int:
        """One whole block, then as many tokens as a hit computes."""
        return BLOCK + self.prompt_tokens - (self.prompt_tokens - 1) // BLOCK * BLOCK

    def args(self, prompts: Path | None = None) -> list[str]:
        return [
            "--model", str(self.model), "--prompts", str(prompts or self.prompts),
            "--block-size", str(BLOCK), "--warmup-tokens", str(self.warmup_tokens),
            "--max-model-len", str(max(4096, self.prompt_tokens + 64)),
        ]  # fmt: skip


def setup(work: Path, quick: bool, settle_s: float) -> Setup:
    if quick:
        shape = ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "4"]
        s = Setup(work, True, 1000, 3, shape, 4, 4, 64, settle_s)
    else:
        shape = ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "2"]
        s = Setup(work, False, 2000, 3, shape, 8, 2, 64, settle_s)
    work.mkdir(parents=True, exist_ok=True)
    ensure_model(s.model, shape)
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, 2048) for _ in range(s.prompt_tokens)]
        for _ in range(s.num_prompts)
    ]
    s.prompts = work / "prompts.json"
    s.prompts.write_text(json.dumps(prompts))
    extra = [[rng.randrange(3, 2048) for _ in range(s.prompt_tokens)] for _ in range(6)]
    s.extra_prompts = work / "extra_prompts.json"
    s.extra_prompts.write_text(json.dumps(extra))
    return s


class Peer:
    """One peer's processes: its config, its directory, its python."""

    def __init__(self, name: str, s: Setup) -> None:
        self.name, self.s = name, s
        self.python: Path | str = (
            hp.lmcache_python() if name == "lmcache" else sys.executable
        )
        self.server: hp.LMCacheServer | None = None

    def config(self, directory: Path, capacity: int | None = None) -> dict[str, Any]:
        if self.name == "example":
            return {
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(directory)},
            }  # fmt: skip
        if self.name == "npukv":
            extra: dict[str, Any] = {"cache_dir": str(directory), "ring_size": "256MiB"}
            if capacity is not None:
                extra["capacity"] = capacity
            return {
                "kv_connector": "NPUKVStoreConnector",
                "kv_connector_module_path": "npukv_store.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": extra,
            }  # fmt: skip
        if self.name == "lmcache":
            self.server = hp.LMCacheServer(
                directory, self.s.work / f"lmcache_server_{time.time_ns()}.log"
            )
            self.server.start()
            return self.server.config()
        if self.name == "offloading_cpu":
            return {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
            }  # fmt: skip
        if self.name == "offloading_fs":
            return {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(directory)}],
                },
            }  # fmt: skip
        return {}

    def stop_server(self, hard: bool = False) -> None:
        if self.server is not None:
            self.server.stop(hard=hard)
            self.server = None

    def run(
        self, tag: str, directory: Path, prompts: Path | None = None,
        capacity: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        try:
            config = self.config(directory, capacity)
            args = [*self.s.args(prompts), "--kv-config", json.dumps(config)]
            return hp.run_vllm(self.python, self.s.work, f"{self.name}_{tag}", args)
        finally:
            self.stop_server()

    def kill_during_save(self, directory: Path) -> dict[str, Any]:
        """A store process killed (SIGKILL, its session and, for LMCache, its
        server) once ``directory`` has grown past the warm-up's KV."""
        config = self.config(directory)
        args = [*self.s.args(), "--kv-config", json.dumps(config)]
        name = f"{self.name}_kill9_store"
        proc = hp.start_vllm(self.python, self.s.work, name, args)
        threshold = 2 * BLOCK * self.s.kv_bytes_per_token
        began = time.monotonic()
        killed_at = None
        while proc.poll() is None and time.monotonic() - began < 900:
            if hp.disk_bytes(directory) > threshold:
                hp.kill_group(proc)
                killed_at = hp.disk_bytes(directory)
                break
            time.sleep(0.005)
        if killed_at is None:
            hp.kill_group(proc)
        self.stop_server(hard=True)
        return {
            "killed_while_running": killed_at is not None,
            "disk_bytes_at_kill": killed_at,
            "store_exit": proc.returncode,
        }


def cold(s: Setup, directory: Path) -> None:
    import os

    os.sync()
    time.sleep(s.settle_s)
    vllm_runs.drop_page_cache(directory)


def fs_tier(s: Setup) -> dict[str, Any]:
    """vLLM's fs tier's file I/O driven directly (no GPU needed), in a process
    of its own, on one prompt's KV in blocks of BLOCK tokens."""
    directory = s.work / "vllm_fs_tier"
    shutil.rmtree(directory, ignore_errors=True)
    out = s.work / "vllm_fs_tier.json"
    block_bytes = BLOCK * s.kv_bytes_per_token
    blocks = s.prompt_tokens // BLOCK
    done = subprocess.run(
        [
            sys.executable, "-m", hp.MODULE, "fs-tier", "--dir", str(directory),
            "--out", str(out), "--blocks", str(blocks),
            "--block-bytes", str(block_bytes),
        ],
        capture_output=True, text=True, env=hp.env_for(sys.executable),
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    found: dict[str, Any] = json.loads(out.read_text())
    return found


def fs_tier_rows(found: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The fs tier's behaviour rows from its direct drive."""
    if "error" in found:
        why = f"its io.py could not be driven: {found['error'][-300:]}"
        return {name: verdict(None, why) for name in BEHAVIOURS}
    mib = 1 << 20
    restart = verdict(
        bool(found["load_equal"]),
        "files named by block hash, read back by a new reader (driven directly: "
        "batch_store_block then batch_load_block)",
    )
    bounded = verdict(
        False,
        f"no capacity and no eviction: {found['disk_bytes_after_3x_more'] / mib:.1f}"
        f" MiB after 3 more rounds of {found['disk_bytes_one_round'] / mib:.1f} MiB",
    )
    native = ""
    if found.get("fs_io_C"):
        fsyncs = "imports fsync" if found.get("fs_io_C_imports_fsync") else "no fsync"
        native = f", {found['fs_io_C']} (the C path it takes): {fsyncs}"
    kill9 = verdict(
        None,
        "not run (needs the engine): each block is written to a temp file and "
        f"renamed, {found['fsync_calls_in_io_py']} fsync calls in io.py{native} "
        "(survives a kill -9 of the process; a power loss can publish an empty "
        "or torn block)",
    )
    corrupt = verdict(
        not found["corrupt_bytes_differ"],
        f"a block file overwritten in place: {found['corrupt_load']}"
        + (
            ", the damaged bytes went into the KV buffer (no checksum)"
            if found["corrupt_bytes_differ"]
            else ""
        ),
    )
    return {"restart": restart, "bounded": bounded, "kill9": kill9, "corrupt": corrupt}


def fs_tier_vs_ours(found: dict[str, Any]) -> dict[str, Any]:
    """The direct drive's figures side by side: vLLM's fs tier's io.py and
    our KVStore on the same blocks (one prompt's KV), load times and what
    capacity and corruption did; ``ours_over_fs_*`` ratios of load times."""
    ours = found.get("ours") or {}
    if "error" in found or not ours:
        return {}
    mib = 1 << 20
    out: dict[str, Any] = {
        "blocks": found["blocks"],
        "block_bytes": found["block_bytes"],
        "fs_load_cold_ms": round(found["load_cold_s"] * 1e3, 2),
        "fs_load_warm_ms": round(found["load_warm_s"] * 1e3, 2),
        "ours_load_cold_ms": round(ours["load_cold_s"] * 1e3, 2),
        "ours_load_warm_ms": round(ours["load_warm_s"] * 1e3, 2),
        "fs_disk_mib_after_3x": round(found["disk_bytes_after_3x_more"] / mib, 1),
        "ours_disk_mib_after_3x": round(ours["disk_bytes_after_3x_more"] / mib, 1),
        "ours_capacity_mib": round(ours["capacity_bytes"] / mib, 1),
        "fs_corrupt": found["corrupt_load"]
        + (", damaged bytes loaded" if found["corrupt_bytes_differ"] else ""),
        "ours_corrupt": f"{ours['corrupt_blocks_refused']} blocks refused (a miss),"
        f" {ours['corrupt_blocks_loaded']} undamaged blocks loaded, equal: "
        f"{ours['corrupt_loaded_equal']}",
    }
    for kind in ("cold", "warm"):
        fs = found[f"load_{kind}_s"]
        out[f"ours_over_fs_{kind}"] = (
            round(ours[f"load_{kind}_s"] / fs, 3) if fs else None
        )
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=3, help="repeats (medians)")
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="comma-separated subset of " + ",".join(PEERS),
    )
    parser.add_argument(
        "--settle", type=float, default=-1.0,
        help="seconds between a sync and a cold hit (default 15, --quick 5)",
    )  # fmt: skip
    parser.add_argument(
        "--no-behaviour", action="store_true", help="only the TTFT rows"
    )


def run(args: argparse.Namespace) -> Report:
    import torch

    report = Report(args)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_peers_"))
    settle = args.settle if args.settle >= 0 else (5.0 if args.quick else 15.0)
    s = setup(work, args.quick, settle)
    cuda = torch.cuda.is_available()
    wanted = [p for p in args.peers.split(",") if p]
    lmcache_missing = hp.have_lmcache()
    skipped: dict[str, str] = {}
    for name in ("offloading_cpu", "offloading_fs"):
        if name in wanted and not cuda:
            skipped[name] = NO_CUDA
    if "lmcache" in wanted and lmcache_missing:
        skipped["lmcache"] = f"skipped: {lmcache_missing}"
    active = [p for p in PEERS if p in wanted and p not in skipped]
    peers = {name: Peer(name, s) for name in active}
    runs: dict[str, dict[str, list[Any]]] = {
        p: {
            "cold": [],
            "warm": [],
            "loaded": [],
            "equal": [],
            "disk": [],
            "psi": [],
        }  # fmt: skip
        for p in active
    }
    none_tokens: list[list[int]] = []
    rows: dict[str, dict[str, Any]] = {}
    errors: dict[str, list[str]] = {}
    first_dirs: dict[str, Path] = {}
    started = time.monotonic()

    def note_error(peer: str, what: str, result: dict[str, Any]) -> bool:
        if "error" in result:
            errors.setdefault(peer, []).append(
                f"{what}: {result['error']}: {result.get('log_tail', '')[-600:]}"
            )
            return True
        return False

    for index in range(args.runs):
        print(f"run {index + 1}/{args.runs} ({time.monotonic() - started:.0f} s)")
        for name in active:
            peer = peers[name]
            directory = work / f"{name}_run{index}"
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            first_dirs.setdefault(name, directory)
            if name == "none":
                result = peer.run(f"run{index}", directory)
                if note_error(name, f"run {index}", result):
                    continue
                none_tokens = none_tokens or tokens_of(result)
                value = ttft_ms(result)
                runs[name]["cold"].append(value)
                runs[name]["warm"].append(value)
                runs[name]["loaded"].append(loaded_of(result))
                runs[name]["equal"].append(tokens_of(result) == none_tokens)
                runs[name]["disk"].append(0)
                runs[name]["psi"].append(psi_ms(result))
                continue
            stored = peer.run(f"store{index}", directory)
            if note_error(name, f"store {index}", stored):
                continue
            runs[name]["disk"].append(hp.disk_bytes(directory))
            cold(s, directory)
            hit = peer.run(f"cold{index}", directory)
            if note_error(name, f"cold {index}", hit):
                continue
            warm = peer.run(f"warm{index}", directory)
            if note_error(name, f"warm {index}", warm):
                continue
            runs[name]["cold"].append(ttft_ms(hit))
            runs[name]["warm"].append(ttft_ms(warm))
            runs[name]["loaded"].append(loaded_of(hit))
            runs[name]["psi"].append(psi_ms(hit))
            equal = tokens_of(hit) == none_tokens and tokens_of(warm) == none_tokens
            runs[name]["equal"].append(equal)
            print(
                f"  {name}: cold {ttft_ms(hit):.1f} ms, warm {ttft_ms(warm):.1f} ms, "
                f"loaded {loaded_of(hit)}, tokens equal {equal}"
            )

    capacity_npukv = 2 * s.prompt_kv_bytes
    written = 6 * s.prompt_kv_bytes
    for name in active:
        got = runs[name]
        row: dict[str, Any] = {
            "label": LABELS[name],
            "ttft_hit_ms": spread([v for v in got["cold"] if v is not None])["median"],
            "ttft_hit_warm_ms": spread([v for v in got["warm"] if v is not None])[
                "median"
            ],
            "ttft_hit": spread([v for v in got["cold"] if v is not None]),
            "ttft_hit_warm": spread([v for v in got["warm"] if v is not None]),
            "tokens_loaded": got["loaded"][0] if got["loaded"] else None,
            "tokens_loaded_runs": got["loaded"],
            "tokens_equal_none": bool(got["equal"]) and all(got["equal"]),
            "disk_bytes": got["disk"][0] if got["disk"] else None,
            "cold_hit_psi_cpu_ms_runs": [
                None if v is None else round(v, 1) for v in got["psi"]
            ],
        }
        if errors.get(name):
            row["errors"] = errors[name]
        rows[name] = row
    for name, why in skipped.items():
        rows[name] = {
            "label": LABELS[name], "ttft_hit_ms": None, "ttft_hit_warm_ms": None,
            "tokens_loaded": None, "tokens_equal_none": None, "disk_bytes": None,
            **{b: verdict(None, why.removeprefix("skipped: ")) for b in BEHAVIOURS},
        }  # fmt: skip

    # -- the behaviour rows, once ------------------------------------------------------
    for name in active:
        row = rows[name]
        if name == "none":
            why = "nothing is stored: every start recomputes"
            row.update({b: verdict(None, why) for b in BEHAVIOURS})
            continue
        if args.no_behaviour:
            row.update({b: verdict(None, "--no-behaviour") for b in BEHAVIOURS})
            continue
        peer = peers[name]
        loaded = row["tokens_loaded"] or 0
        row["restart"] = verdict(
            bool(loaded) and row["tokens_equal_none"],
            f"a fresh process loaded {loaded} tokens"
            + (" (and a fresh LMCache server)" if name == "lmcache" else "")
            + f", tokens equal none's: {row['tokens_equal_none']}",
        )
        print(f"{name}: bounded ({time.monotonic() - started:.0f} s)")
        directory = work / f"{name}_bounded"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        capacity = capacity_npukv if name == "npukv" else None
        result = peer.run("bounded", directory, s.extra_prompts, capacity=capacity)
        if note_error(name, "bounded", result):
            row["bounded"] = verdict(
                False, f"the store process failed: {result['error']}"
            )
        else:
            row["bounded"] = bounded_verdict(
                hp.disk_bytes(directory), capacity, written
            )
            row["bounded_disk_bytes"] = hp.disk_bytes(directory)
            row["capacity_bytes"] = capacity
        print(f"{name}: kill -9 ({time.monotonic() - started:.0f} s)")
        directory = work / f"{name}_kill9"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        kill = peer.kill_during_save(directory)
        after = peer.run("kill9_next", directory)
        row["kill9_detail"] = kill
        if note_error(name, "kill9 next start", after):
            row["kill9"] = verdict(False, f"the next start failed: {after['error']}")
        else:
            equal = tokens_of(after) == none_tokens
            when = (
                f"killed at {kill['disk_bytes_at_kill']} bytes on disk"
                if kill["killed_while_running"]
                else "the store process ended before the kill"
            )
            row["kill9"] = verdict(
                equal if kill["killed_while_running"] else None,
                f"{when}; the next start loaded {loaded_of(after)} tokens, "
                f"tokens equal none's: {equal}",
            )
        print(f"{name}: corrupt ({time.monotonic() - started:.0f} s)")
        directory = first_dirs[name]
        damaged = hp.largest_data_file(directory)
        if damaged is None:
            row["corrupt"] = verdict(None, "no data file in the store's directory")
            continue
        where = hp.corrupt(damaged)
        row["corrupt_file"] = str(damaged.relative_to(directory))
        cold(s, directory)
        after = peer.run("corrupt", directory)
        row["corrupt"] = corrupt_verdict(after, none_tokens, loaded)
        row["corrupt"]["reason"] += (
            f" ({damaged.name}: {where[1]} bytes at {where[0]} overwritten)"
        )

    fs_found: dict[str, Any] = {}
    if "offloading_fs" in wanted:
        fs_found = fs_tier(s)
        report.data["vllm_fs_tier_direct"] = fs_found
        report.data["fs_tier_vs_ours"] = fs_tier_vs_ours(fs_found)
        if not cuda:
            rows["offloading_fs"]["direct"] = fs_tier_rows(fs_found)

    cold_ttft = {p: rows[p]["ttft_hit_ms"] for p in rows}
    warm_ttft = {p: rows[p]["ttft_hit_warm_ms"] for p in rows}
    ratio = ratios(cold_ttft)
    ratio_warm = {f"{k}_warm": v for k, v in ratios(warm_ttft).items()}
    report.data.update(
        runs=args.runs,
        geometry={
            "model_shape": s.shape,
            "prompt_tokens": s.prompt_tokens,
            "prompts": s.num_prompts,
            "block_size": BLOCK,
            "dtype": "float32",
            "prompt_kv_bytes": s.prompt_kv_bytes,
            "settle_s": s.settle_s,
            "cache_drop_method": vllm_runs.DROP_METHOD,
        },  # fmt: skip
        cuda=cuda,
        peers={p: rows[p] for p in PEERS if p in rows},
        **ratio,
        **ratio_warm,
        targets=targets(rows, ratio),
        seconds=round(time.monotonic() - started, 1),
    )
    print_table(report.data)
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(data: dict[str, Any]) -> None:
    head = [
        "peer", "hit cold ms (min-max)", "hit warm ms", "loaded", "tokens=none",
        "disk MiB", *BEHAVIOURS,
    ]  # fmt: skip
    lines = []
    for row in data["peers"].values():
        hit = row.get("ttft_hit") or {}
        span = (
            f"{_ms(hit.get('median'))} ({_ms(hit.get('min'))}-{_ms(hit.get('max'))})"
            if hit.get("median") is not None
            else "-"
        )
        disk = row.get("disk_bytes")
        lines.append(
            [
                row["label"], span, _ms(row.get("ttft_hit_warm_ms")),
                "-" if row.get("tokens_loaded") is None else row["tokens_loaded"],
                row.get("tokens_equal_none"),
                "-" if disk is None else f"{disk / (1 << 20):.1f}",
                *(row.get(b, {}).get("status", "-") for b in BEHAVIOURS),
            ]
        )  # fmt: skip
    print(table(head, lines))
    for row in data["peers"].values():
        for b in BEHAVIOURS:
            if b in row:
                print(f"  {row['label']} {b}: {row[b]['status']}: {row[b]['reason']}")
        for b, v in row.get("direct", {}).items():
            label = f"{row['label']} (io.py driven directly)"
            print(f"  {label} {b}: {v['status']}: {v['reason']}")
        for error in row.get("errors", []):
            print(f"  {row['label']} error: {error[:300]}")
    if data.get("fs_tier_vs_ours"):
        print("vLLM's fs tier's io.py and our KVStore, driven directly on the same")
        print("blocks (one prompt's KV):", json.dumps(data["fs_tier_vs_ours"]))
    shown = {k: v for k, v in data.items() if k.startswith("ours_over_")}
    print("npukv_store's TTFT over each peer's:", shown)
    print("targets:", json.dumps(data["targets"]))
