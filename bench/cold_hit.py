"""Where a cold hit's time goes in real vLLM, by phase and by stage, ours and Example's.

From the request's arrival to its first token: a cold hit of our connector
(fresh process, page cache dropped), full (every stored block of the prompt)
and partial (the prompt's first half stored, the rest computed), next to
vLLM's own prefix-cache hit of the same tokens in the same run (the floor:
nothing loaded), a hit from host memory (bench/harness/memory_connector.py)
and ExampleConnector's cold hit. Per token count (``--tokens``, default
2,000 and 16,000): each row its own vLLM process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), the page cache dropped before the cold
rows (the same settle and drop as ``bench vllm``).

Geometry (bench/harness/cold_geometry.py): issue 41's reference, a
random-weight Llama of 8 layers, hidden 512, 8 heads of 64, fp32 weights and
KV (vLLM's CPU build keeps the KV in the model's dtype), block 64, 3 timed
prompts per token count (``--prompts``); ``--quick``: ``bench vllm
--quick``'s, 4 layers, hidden 256, block 32, 1,000 tokens unless
``--tokens`` says. The partial floor is arranged in one process: each
prompt's first half (whole blocks) is sent first, then the prompt, a hit on
the half in vLLM's prefix cache; ours stores the halves in one process and
sends the prompts in a fresh one. Both partial rows first send a warm-up
pair of the partial hit's shape (a half, then it extended), so the timed
prompts run no shape for the first time; the full rows' warm-up is the
harness's (whole blocks plus a full hit's tail, twice).

Non-invasive: the hit processes run ``python -m bench.harness.vllm_run run
--trace FILE``, whose tracer (bench/harness/trace.py; its targets in
bench/harness/trace_targets.py) wraps vLLM's steps, every connector hook,
our scheduler and worker internals (SchedulerSide.match / _keys / _hit,
KVStore.lookup / read_many, LayerLoader, ChunkReader.read_chunks / read_rows
/ _header / _read_layers, parse_header, the read routes,
native.pread_layers_xxh3, the checksum verification, the CPU backend's
copy), ExampleConnector's load and copy, and a few os calls, before vLLM
starts. Each wrapper keeps perf_counter timestamps, the thread's CPU time
(time.thread_time_ns) and its major page faults; each generate() call also
keeps the process's CPU (/proc/self/task schedstat), /proc/self/io
read_bytes and major faults.

Two tables per token count. By phase (bench/harness/cold_phases.py): the
milliseconds inside the generate() call of the median prompt (by TTFT; one
prompt's rows add up; a phase on several threads sums their time; indented
rows are inside the row above them), major faults in brackets, then how long
the engine thread, the process and the machine (PSI) waited for a CPU. By
stage (bench/harness/cold_stages.py), full hits and partial hits: the
scheduler's lookup and load policy, metadata, the worker's plan, I/O issue
and wait, verify, copies, host-to-device, the connector's other hooks and
vLLM's own share, each as wall ms on the request's thread (they add up to
the TTFT) / CPU ms of every thread, and the process CPU the spans do not
hold. On vLLM's CPU build ours reads straight into the KV pages: its copies
and host-to-device rows stay near zero by design.

JSON (bench.report): per token count ``runs[N]`` (phase columns, stage
columns, the raw cold read, tokens loaded); ``hits[N][full|partial]`` (the
figures below and ours' and the floor's stage tables); flat keys per token
count and hit kind: ``ttft_ms_N_full``, ``floor_ttft_ms_N_full``,
``ttft_over_floor_N_full``, ``cpu_ms_N_full``, ``floor_cpu_ms_N_full``,
``cpu_over_floor_N_full`` (and ``_partial``), medians over the timed prompts;
``targets``: ``ttft_over_floor_N_full`` <= 1.5 (issue 41; the exit status
does not depend on it: the figure needs a quiet machine).

``py-spy`` (``--py-spy``) records one more full cold hit of ours at the first
token count, only while the timed prompts run. Two environment knobs for the
traced processes: NPUKV_TRACE_THREADS=1 keeps, for each start_load_kv, every
thread's CPU and run-queue milliseconds; NPUKV_PROFILE_READ_TUNING=
'{"verify_threads": 2}' starts every ChunkReader from those ReadTuning fields.

Run: ``python -m bench cold_hit [--tokens 2000,16000] [--prompts 3] [--quick]
[--rows floor,memory,ours,example,partial] [--dir DIR] [--json PATH]
[--py-spy] [--warm]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import vllm_runs
from bench.harness.cold_geometry import QUICK, REFERENCE, ColdGeometry, cold_geometry
from bench.harness.cold_phases import print_table, summarise, summarise_py_spy
from bench.harness.cold_stages import hits, print_stages, ratio_keys, summarise_stages
from bench.harness.processes import child_env, python_module
from bench.report import Report

ROWS = ("floor", "memory", "ours", "example", "partial")


def _traced(geo: ColdGeometry, name: str, args: list[str], **kw: Any) -> dict[str, Any]:
    trace = geo.work / f"{name}.trace.json"
    report = vllm_runs.harness(geo.work, name, [*args, "--trace", str(trace)], **kw)
    data: dict[str, Any] = json.loads(trace.read_text())
    data["report"] = report
    return data


def _py_spy(geo: ColdGeometry, name: str, args: list[str]) -> Path:
    """One more cold hit of ours under py-spy, recorded only while its timed
    prompts run (the harness pauses after its warm-up until told to go)."""
    gate = geo.work / f"{name}.gate"
    shutil.rmtree(gate, ignore_errors=True)
    gate.mkdir()
    out = geo.work / f"{name}.pyspy.txt"
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = python_module(
        vllm_runs.HARNESS, "run", "--out", str(geo.work / f"{name}.json"),
        *args, "--pause-after-warmup", str(gate),
    )  # fmt: skip
    with open(geo.work / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while not (gate / "ready").exists():
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited before its warm-up ended")
            time.sleep(0.05)
        spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        spy = subprocess.Popen(
            [
                spy_bin, "record", "--pid", str(proc.pid), "--rate", "1000",
                "--native", "--idle", "--threads", "--format", "raw",
                "--output", str(out),
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        time.sleep(1.5)  # py-spy attached
        (gate / "go").touch()
        while not (gate / "done").exists() and proc.poll() is None:
            time.sleep(0.02)
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
        (gate / "exit").touch()
        proc.wait(timeout=600)
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument(
        "--tokens", default="",
        help="prompt tokens, comma-separated (default 2000,16000; --quick: 1000)",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=3, help="timed prompts per row")
    parser.add_argument(
        "--rows", default=",".join(ROWS),
        help="rows to run, of floor,memory,ours,example,partial (the floor and "
        "ours always run; partial: their partial hits)",
    )  # fmt: skip
    parser.add_argument("--py-spy", action="store_true", help="also py-spy a cold hit")
    parser.add_argument("--warm", action="store_true", help="also trace warm hits")


def _cold(path: Path) -> None:
    """Evict ``path``'s files from the page cache (after a settle, once)."""
    vllm_runs.drop_page_cache(path)


def _loaded(trace: dict[str, Any], n: int) -> list[int | None]:
    """Tokens the connector claimed for each of the last ``n`` prompts."""
    results = trace["report"].get("results", [])[-n:]
    return [r.get("external_tokens") for r in results]


def run_tokens(
    geo: ColdGeometry, rows: set[str], args: argparse.Namespace, py_spy: bool
) -> dict[str, Any]:
    """Every row at one token count; prints its tables, returns its JSON."""
    partial = "partial" in rows
    for stale in ("ours_cache", "ours_half", "example"):
        shutil.rmtree(geo.work / stale, ignore_errors=True)
    traces: dict[str, dict[str, Any]] = {}
    pairs = {"floor", "floor partial", "memory"}
    traces["floor"] = _traced(geo, "floor", geo.floor())
    if partial:
        traces["floor partial"] = _traced(geo, "floor_partial", geo.floor(True))
    if "memory" in rows:
        traces["memory"] = _traced(geo, "memory", geo.memory())
    ours = geo.ours("ours_cache", "prompts.json")
    half = geo.ours("ours_half", "partial.json")
    vllm_runs.harness(geo.work, "ours_store", ours)
    if partial:
        vllm_runs.harness(
            geo.work, "ours_store_half", geo.ours("ours_half", "halves.json")
        )
    if "example" in rows:
        vllm_runs.harness(geo.work, "example_store", geo.example())
    vllm_runs.settle_after_writes()  # once: the cold case is a restart
    _cold(geo.work / "ours_cache")
    raw_s, raw_bytes = vllm_runs.raw_cold_read(geo.work / "ours_cache")
    _cold(geo.work / "ours_cache")
    traces["ours cold"] = _traced(geo, "ours_hit", ours)
    if args.warm:
        traces["ours warm"] = _traced(geo, "ours_hit_warm", ours)
    if partial:
        _cold(geo.work / "ours_half")
        traces["ours partial cold"] = _traced(geo, "ours_hit_half", half)
    if "example" in rows:
        _cold(geo.work / "example")
        traces["Example cold"] = _traced(geo, "example_hit", geo.example())
        if args.warm:
            traces["Example warm"] = _traced(geo, "example_hit_warm", geo.example())
    phases: dict[str, dict[str, Any]] = {}
    stages: dict[str, dict[str, Any]] = {}
    for name, trace in traces.items():
        timed = geo.timed(len(trace["windows"]), name in pairs)
        phases[name] = summarise(trace, timed)
        stages[name] = summarise_stages(trace, timed)
    n = geo.num_prompts
    loaded = {
        "ours cold": _loaded(traces["ours cold"], n),
        "expected_full": geo.stored_tokens_per_prompt,
    }
    if partial:
        loaded["ours partial cold"] = _loaded(traces["ours partial cold"], n)
        loaded["expected_partial"] = geo.half
    print(f"\n== {geo.tokens} tokens: by phase (wall ms) ==")
    print_table(phases)
    print()
    full = [k for k in stages if "partial" not in k]
    print_stages(f"{geo.tokens} tokens, full hit", {k: stages[k] for k in full})
    if partial:
        print()
        part = [k for k in stages if "partial" in k]
        print_stages(f"{geo.tokens} tokens, partial", {k: stages[k] for k in part})
    prompt_bytes = geo.stored_tokens_per_prompt * geo.shape.bytes_per_token
    per_prompt = raw_s * prompt_bytes / max(raw_bytes, 1)  # one prompt's KV, s
    floor_ms = stages["floor"]["ttft_median_ms"]
    print(
        f"raw cold read {raw_bytes / raw_s / 1e9:.3f} GB/s: disk bound "
        f"{floor_ms + per_prompt * 1e3:.1f} ms (floor {floor_ms:.1f} + "
        f"{per_prompt * 1e3:.1f} ms per prompt); tokens loaded: {loaded}"
    )
    spy: dict[str, Any] | None = None
    if py_spy:
        _cold(geo.work / "ours_cache")
        spy = summarise_py_spy(_py_spy(geo, "ours_hit_spy", ours))
        print("\npy-spy, the cold hit's timed prompts; samples per thread:")
        for thread, seen in spy["threads"].items():
            print(f"{seen['samples']:>6} ({seen['idle']} idle)  {thread}")
        for frame, count in spy["main_thread_frames"]:
            print(f"{count:>6}  {frame[:140]}")
    return {
        "tokens": geo.tokens,
        "half_tokens": geo.half,
        "columns": phases,
        "stages": stages,
        "tokens_loaded": loaded,
        "raw_cold_read_s": raw_s,
        "raw_cold_read_bytes": raw_bytes,
        "raw_per_prompt_ms": per_prompt * 1e3,
        **({"py_spy": spy} if spy is not None else {}),
    }


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    shape = QUICK if args.quick else REFERENCE
    text = args.tokens or ("1000" if args.quick else "2000,16000")
    tokens = [int(t) for t in text.split(",") if t.strip()]
    rows = {r.strip() for r in args.rows.split(",") if r.strip()}
    unknown = rows - set(ROWS)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}, expected {ROWS}")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cold_hit_"))
    runs: dict[str, Any] = {}
    results: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for index, geo in enumerate(cold_geometry(work, shape, tokens, args.prompts)):
        one = run_tokens(geo, rows, args, py_spy=args.py_spy and index == 0)
        runs[str(geo.tokens)] = one
        stages = one["stages"]
        results[geo.tokens] = {
            "full": {"ours": stages["ours cold"], "floor": stages["floor"]}
        }
        if "ours partial cold" in stages:
            results[geo.tokens]["partial"] = {
                "ours": stages["ours partial cold"], "floor": stages["floor partial"]
            }  # fmt: skip
    keys, targets = ratio_keys(results)
    print("\n" + "\n".join(f"{k}: {v}" for k, v in keys.items()))
    print("targets:", json.dumps(targets))
    report.data.update(
        geometry={
            **vars(shape), "tokens": tokens, "prompts": args.prompts,
            "rows": sorted(rows), "work": str(work),
        },
        hits=hits(results),
        runs=runs,
        **keys,
        targets=targets,
    )  # fmt: skip
    return report
