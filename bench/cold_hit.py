"""Where a cold hit's time goes in real vLLM, phase by phase, ours and Example's.

The cold hits of our connector and of vLLM's ExampleConnector, next to a hit
that loads nothing (vLLM's prefix cache: the floor) and a hit from host memory
(bench/harness/memory_connector.py).

Always the geometry of ``python -m bench vllm --quick`` (bench/vllm_runs.py,
``--quick`` changes nothing here): a random-weight Llama (4 layers, hidden
256), 3 prompts of 1,000 tokens, every row its own vLLM process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), the page cache dropped before the cold
rows (the same settle and drop as the benchmark).

Non-invasive: the hit processes run ``python -m bench.harness.vllm_run run
--trace FILE``, whose tracer (bench/harness/trace.py) wraps vLLM's steps,
every connector hook, our scheduler and worker internals (SchedulerSide.match
/ _keys / _hit, KVStore.lookup / read_many, LayerLoader, ChunkReader.read_chunks
/ read_rows / _header / _read_layers, parse_header, the read routes,
native.pread_layers_xxh3, the checksum verification, the CPU backend's copy),
ExampleConnector's load and copy, and a few os calls, before vLLM starts.
Each wrapper keeps perf_counter timestamps and the thread's major page faults
(getrusage RUSAGE_THREAD: a fault that read from disk); each generate() call
also keeps the process's /proc/self/io read_bytes (what it read from the
disk) and major faults.

The table: per phase, the milliseconds inside the generate() call of the
median prompt (by TTFT; one prompt's rows add up, per-row medians would mix
prompts; a phase on several threads sums their time; indented rows are inside
the row above them), with major page faults in brackets where there were any,
then how long the engine thread, all of the process's threads and the
machine (PSI) waited for a CPU meanwhile; below it each prompt's TTFT, disk
bytes, faults and CPU waits, and the code the warm-up did not run.
``py-spy`` (``--py-spy``) records one more cold hit of ours, only while the
timed prompts run (the harness waits after its warm-up,
``--pause-after-warmup``), idle threads included.

Two environment knobs for the traced processes: NPUKV_TRACE_THREADS=1 keeps,
for each start_load_kv, every thread's CPU and run-queue milliseconds (which
threads ran during a load: vLLM's second OpenMP thread, our verifiers,
io_uring's io-wq workers); NPUKV_PROFILE_READ_TUNING='{"verify_threads": 2}'
starts every ChunkReader from those ReadTuning fields (to compare tunings).

Run: ``python -m bench cold_hit [--dir DIR] [--json PATH] [--py-spy]
[--warm]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import vllm_runs
from bench.harness.processes import child_env, python_module
from bench.report import Report, table

# -- the analysis -------------------------------------------------------------------

#: (label, indent, title) of the table's rows, in order; None label: a derived row
ROWS: list[tuple[str, int, str]] = [
    ("generate", 0, "TTFT: generate(max_tokens=1)"),
    ("llm.add_request", 1, "add_request (input processing)"),
    ("engine.step", 1, "EngineCore.step"),
    ("sched.schedule", 2, "Scheduler.schedule"),
    ("kvm.get_computed_blocks", 3, "KVCacheManager.get_computed_blocks"),
    ("conn.get_num_new_matched_tokens", 3, "connector: get_num_new_matched_tokens"),
    ("ours.keys", 4, "ours: key chain (xxh3)"),
    ("store.lookup", 4, "ours: KVStore.lookup (LMDB)"),
    ("index.lookup_prefix", 5, "Index.lookup_prefix"),
    ("example.found_match", 4, "Example: _found_match (os.path.exists)"),
    ("kvm.allocate_slots", 3, "KVCacheManager.allocate_slots"),
    ("conn.update_state_after_alloc", 3, "connector: update_state_after_alloc"),
    ("conn.build_connector_meta", 3, "connector: build_connector_meta"),
    ("executor.execute_model", 2, "execute_model (the step that loads)"),
    ("runner._update_states", 3, "runner._update_states"),
    ("runner._zero_block_ids", 4, "runner._zero_block_ids (new blocks zeroed)"),
    ("runner._prepare_inputs", 3, "runner._prepare_inputs"),
    ("runner._build_attention_metadata", 3, "runner._build_attention_metadata"),
    ("conn.bind_connector_metadata", 3, "connector: bind_connector_metadata"),
    ("conn.start_load_kv", 3, "connector: start_load_kv"),
    ("loader.run", 4, "ours: LayerLoader.run"),
    ("store.read_many", 5, "KVStore.read_many"),
    ("index.locate", 6, "Index.locate (LMDB)"),
    ("reader.read_chunks", 6, "ChunkReader.read_chunks"),
    ("reader.read_rows", 7, "ChunkReader.read_rows (per chunk)"),
    ("os.open", 8, "os.open (all files, all threads)"),
    ("os.posix_fadvise", 8, "os.posix_fadvise"),
    ("reader.header", 8, "ChunkReader._header"),
    ("headers.get", 9, "ChunkHeaders.get"),
    ("parse_header", 10, "parse_header (header reads)"),
    ("reader.read_layers", 8, "ChunkReader._read_layers"),
    ("reader.plan", 9, "plan (page-cache residency)"),
    ("native.cached_pages", 10, "native.cached_pages (mincore)"),
    ("files.open_direct", 9, "open O_DIRECT fd"),
    ("reader.engine", 9, "ChunkReader._engine (per-thread engine)"),
    ("route.engine", 9, "route: I/O engine (direct/buffered)"),
    ("engine.submit", 10, "UringEngine.submit"),
    ("engine.reap", 10, "UringEngine.reap (waits for the disk)"),
    ("route.streamed", 9, "route: streamed"),
    ("route.cached", 9, "route: cached"),
    ("native.pread_layers_xxh3", 10, "native.pread_layers_xxh3 (read+hash)"),
    ("verify.check_layer", 9, "verify: check_layer (xxh3)"),
    ("loader.load_layers", 5, "LayerLoader._load_layers (slot path)"),
    ("loader.read_layer", 6, "LayerLoader._read_layer"),
    ("device.copy_runs", 6, "device copy into KV pages (copy_runs)"),
    ("example.filename", 4, "Example: _generate_filename (makedirs)"),
    ("os.makedirs", 5, "os.makedirs"),
    ("safetensors.load_file", 4, "Example: safetensors load_file (open+read)"),
    ("example.inject (Tensor.__setitem__)", 4, "Example: copy into KV cache"),
    ("memory.load", 4, "memory: copy into KV cache"),
    ("runner._model_forward", 3, "runner._model_forward (vLLM's forward)"),
    ("conn.wait_for_layer_load", 4, "connector: wait_for_layer_load (all layers)"),
    ("conn.save_kv_layer", 4, "connector: save_kv_layer (all layers)"),
    ("conn.wait_for_save", 3, "connector: wait_for_save"),
    ("conn.get_finished", 3, "connector: get_finished"),
    ("conn.build_connector_worker_meta", 3, "connector: build_connector_worker_meta"),
    ("runner.sample_tokens", 2, "sample_tokens"),
    ("sched.update_from_output", 2, "Scheduler.update_from_output"),
    ("conn.request_finished", 3, "connector: request_finished"),
    ("conn.update_connector_output", 3, "connector: update_connector_output"),
    ("conn.get_kv_connector_stats", 3, "connector: get_kv_connector_stats"),
    ("engine.post_step", 1, "EngineCore.post_step"),
    ("output.process_outputs", 1, "OutputProcessor.process_outputs"),
]
#: derived rows: title, the label, minus these labels (same window)
DERIVED: list[tuple[str, int, str, list[str]]] = [
    (
        "execute_model: rest (inputs, metadata, hooks)",
        3,
        "executor.execute_model",
        [
            "runner._update_states",
            "runner._prepare_inputs",
            "runner._build_attention_metadata",
            "conn.bind_connector_metadata",
            "conn.start_load_kv",
            "runner._model_forward",
            "conn.wait_for_save",
            "conn.get_finished",
            "conn.build_connector_worker_meta",
        ],
    ),
    (
        "generate: outside engine steps and output",
        1,
        "generate",
        [
            "llm.add_request",
            "engine.step",
            "engine.post_step",
            "output.process_outputs",
        ],
    ),
]


def window_totals(
    trace: dict[str, Any], window: dict[str, float]
) -> dict[str, tuple[float, int, int]]:
    """label -> (ms inside the window, calls, major faults) for one window."""
    t0, t1 = window["t0"], window["t1"]
    totals: dict[str, list[float]] = {}
    for label, _, began, ended, faults in trace["spans"]:
        if ended <= t0 or began >= t1:
            continue
        entry = totals.setdefault(label, [0.0, 0, 0])
        entry[0] += (min(ended, t1) - max(began, t0)) * 1e3
        entry[1] += 1
        entry[2] += faults
    totals["generate"] = [(t1 - t0) * 1e3, 1, int(window["majflt"])]
    return {k: (v[0], int(v[1]), int(v[2])) for k, v in totals.items()}


_CONTENTION_KEYS = (
    "main_cpu_ms", "main_runqueue_ms", "process_cpu_ms", "process_runqueue_ms",
    "psi_cpu_some_ms", "steal_ms", "nivcsw",
)  # fmt: skip


def summarise(trace: dict[str, Any], timed: list[int]) -> dict[str, Any]:
    """The breakdown of the prompt whose TTFT is the median of the windows
    ``timed`` (one prompt's rows add up; per-row medians would mix prompts),
    plus every timed prompt's TTFT, disk reads, faults and CPU waits."""
    windows = [trace["windows"][i] for i in timed]
    per = [window_totals(trace, w) for w in windows]
    ttfts = [(w["t1"] - w["t0"]) * 1e3 for w in windows]
    middle = sorted(range(len(ttfts)), key=ttfts.__getitem__)[len(ttfts) // 2]
    chosen = per[middle]
    rows: dict[str, dict[str, float]] = {
        label: {"ms": v[0], "calls": v[1], "majflt": v[2]}
        for label, v in chosen.items()
    }
    for title, _, base, minus in DERIVED:
        if base in chosen:
            rest = chosen[base][0] - sum(chosen.get(m, (0.0, 0, 0))[0] for m in minus)
            rows[title] = {"ms": rest, "calls": 0, "majflt": 0}
    labels = {label for totals in per for label in totals}
    warm_labels = {
        label
        for w in trace["windows"][: min(timed)]  # the warm-up's (and the pairs')
        for label in window_totals(trace, w)
    }
    return {
        "rows": rows,
        "median_prompt": middle,
        "ttft_ms": [round(t, 2) for t in ttfts],
        "read_bytes": [int(w["read_bytes"]) for w in windows],
        "majflt": [int(w["majflt"]) for w in windows],
        "contention": {
            key: [round(float(w.get(key, 0.0)), 2) for w in windows]
            for key in _CONTENTION_KEYS
        },
        "first_seen_after_warmup": sorted(labels - warm_labels),
        "missing": trace.get("missing", []),
    }


def print_table(columns: dict[str, dict[str, Any]]) -> None:
    names = list(columns)
    derived = {base: (title, indent) for title, indent, base, _ in DERIVED}
    rows: list[list[str]] = []
    for label, indent, title in ROWS:
        lines = [(label, indent, title)]
        if label in derived:
            d_title, d_indent = derived[label]
            lines.append((d_title, d_indent, d_title))
        for key, ind, text in lines:
            cells = []
            for name in names:
                row = columns[name]["rows"].get(key)
                if row is None:
                    cells.append("")
                    continue
                cell = f"{row['ms']:.2f}"
                if row["majflt"]:
                    cell += f" [{row['majflt']:.0f}f]"
                cells.append(cell)
            if any(cells):
                rows.append(["  " * ind + text, *cells])
    for key, title in (
        ("main_runqueue_ms", "main thread waiting for a CPU"),
        ("process_runqueue_ms", "all threads waiting for a CPU"),
        ("psi_cpu_some_ms", "machine: some task waiting (PSI)"),
    ):
        values = [
            columns[name]["contention"][key][columns[name]["median_prompt"]]
            for name in names
        ]
        rows.append([title, *(f"{value:.2f}" for value in values)])
    print(table(["phase (ms; the median prompt; [f]: major faults)", *names], rows))
    print()
    for name in names:
        column = columns[name]
        print(
            f"{name}: TTFT per prompt {column['ttft_ms']} ms, read from disk "
            f"{[round(b / 1e6, 2) for b in column['read_bytes']]} MB, major faults "
            f"{column['majflt']}, main thread waiting for a CPU "
            f"{column['contention']['main_runqueue_ms']} ms"
        )
        if column["first_seen_after_warmup"]:
            print(f"  first run after the warm-up: {column['first_seen_after_warmup']}")
        if column["missing"]:
            print(f"  not wrapped: {column['missing']}")


# -- the runs -----------------------------------------------------------------------


def _traced(
    geo: vllm_runs.Geometry, name: str, args: list[str], **kw: Any
) -> dict[str, Any]:
    trace = geo.work / f"{name}.trace.json"
    report = vllm_runs.harness(geo.work, name, [*args, "--trace", str(trace)], **kw)
    data: dict[str, Any] = json.loads(trace.read_text())
    data["report"] = report
    return data


def _py_spy(geo: vllm_runs.Geometry, name: str, args: list[str]) -> Path:
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


_IDLE = ("PyThread_acquire_lock_timed", "pthread_cond", "epoll_wait", "select")


def summarise_py_spy(path: Path, top: int = 30) -> dict[str, Any]:
    """py-spy's ``--format raw`` (``thread (tid): name;root;...;leaf count``
    lines) summed: per thread its samples and how many were idle (waiting on
    a lock or condition), and the main thread's most sampled frames,
    inclusive (a frame counts once per stack), the gate's polling left out."""
    threads: dict[str, list[int]] = {}
    frames: dict[str, int] = {}
    if not path.exists():
        return {"threads": {}, "main_thread_frames": [], "main_thread_ours": []}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or "_wait_for_gate" in stack:
            continue
        count = int(count_text)
        parts = stack.split(";")
        thread, tail = parts[0], ";".join(parts[-3:])
        entry = threads.setdefault(thread, [0, 0])
        entry[0] += count
        entry[1] += count if any(word in tail for word in _IDLE) else 0
        if "MainThread" in thread:
            for frame in dict.fromkeys(parts[1:]):
                frames[frame] = frames.get(frame, 0) + count
    main = max((n for t, (n, _) in threads.items() if "MainThread" in t), default=0)
    ranked = sorted(frames.items(), key=lambda item: -item[1])
    return {
        "threads": {t: {"samples": n, "idle": i} for t, (n, i) in threads.items()},
        "main_thread_samples": main,
        # the common ancestors (generate, the engine step) left out
        "main_thread_frames": [(f, n) for f, n in ranked if n < 0.6 * main][:top],
        "main_thread_ours": [(f, n) for f, n in ranked if "npukv_store" in f][:top],
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument("--py-spy", action="store_true", help="also py-spy a cold hit")
    parser.add_argument("--warm", action="store_true", help="also trace warm hits")


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    geo = vllm_runs.geometry(Path(args.dir) if args.dir else None, quick=True)
    for stale in ("ours_cache", "example"):
        shutil.rmtree(geo.work / stale, ignore_errors=True)

    def cold(kv: Path) -> None:  # the benchmark's cold treatment
        vllm_runs.settle_after_writes()
        vllm_runs.drop_page_cache(kv)

    n = geo.num_prompts
    columns: dict[str, dict[str, Any]] = {}
    traces: dict[str, dict[str, Any]] = {}
    traces["floor"] = _traced(geo, "floor", geo.floor)
    traces["memory"] = _traced(geo, "memory", geo.memory)
    vllm_runs.harness(geo.work, "ours_store", [*geo.ttft, *geo.ours("ours_cache")])
    cold(geo.work / "ours_cache")
    raw_s, raw_bytes = vllm_runs.raw_cold_read(geo.work / "ours_cache")
    cold(geo.work / "ours_cache")
    ours = [*geo.ttft, *geo.ours("ours_cache")]
    traces["ours cold"] = _traced(geo, "ours_hit", ours)
    if args.warm:
        traces["ours warm"] = _traced(geo, "ours_hit_warm", ours)
    vllm_runs.harness(geo.work, "example_store", [*geo.ttft, *geo.example])
    cold(geo.work / "example")
    example = [*geo.ttft, *geo.example]
    traces["Example cold"] = _traced(geo, "example_hit", example)
    if args.warm:
        traces["Example warm"] = _traced(geo, "example_hit_warm", example)
    for name, trace in traces.items():
        count = len(trace["windows"])  # the warm-ups' first, then the prompts'
        if name in ("floor", "memory"):  # the second of each pair
            timed = list(range(count - 2 * n + 1, count, 2))
        else:
            timed = list(range(count - n, count))
        columns[name] = summarise(trace, timed)
    raw_per_prompt = raw_s * geo.stored_tokens_per_prompt / geo.stored_tokens
    print_table(columns)
    floor_ms = statistics.median(columns["floor"]["ttft_ms"])
    print(
        f"raw cold read {raw_bytes / raw_s / 1e9:.3f} GB/s: disk bound "
        f"{floor_ms + raw_per_prompt * 1e3:.1f} ms (floor {floor_ms:.1f} + "
        f"{raw_per_prompt * 1e3:.1f} ms per prompt)"
    )
    memory_loads = traces["memory"].get("memory_load_s") or []
    if memory_loads:
        print(
            f"memory connector: copies {[round(s * 1e3, 2) for s in memory_loads]} ms"
        )
    report.data.update(
        columns=columns,
        raw_cold_read_s=raw_s,
        raw_cold_read_bytes=raw_bytes,
        raw_per_prompt_ms=raw_per_prompt * 1e3,
    )
    if args.py_spy:
        cold(geo.work / "ours_cache")
        spy = _py_spy(geo, "ours_hit_spy", ours)
        report.data["py_spy"] = summary = summarise_py_spy(spy)
        print(f"\npy-spy, the cold hit's timed prompts ({spy}); samples per thread:")
        for thread, seen in summary["threads"].items():
            print(f"{seen['samples']:>6} ({seen['idle']} idle)  {thread}")
        for key, title in (
            ("main_thread_frames", "main thread, inclusive samples per frame"),
            ("main_thread_ours", "main thread, in npukv_store"),
        ):
            print(f"{title} (of {summary['main_thread_samples']}):")
            for frame, count in summary[key]:
                print(f"{count:>6}  {frame[:140]}")
    return report
