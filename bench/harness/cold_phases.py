"""A traced hit's time phase by phase, wall ms (bench/cold_hit.py's first
table): per wrapped call of bench/harness/trace_targets.py, the time inside
one generate() call, with major page faults; and py-spy's raw output summed.

    window_totals(trace, window)   label -> (ms, calls, major faults)
    summarise(trace, timed)        the median prompt's rows, every timed
                                   prompt's TTFT, disk reads, faults, CPU waits
    print_table(columns)           the table, indented as the calls nest
    summarise_py_spy(path)         samples per thread, the main thread's frames
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import table

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
    ("device.copy_runs", 6, "copy_runs (H2D of a load; D2H of a save)"),
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
    for label, _, began, ended, faults, *_ in trace["spans"]:
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
