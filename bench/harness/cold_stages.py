"""A traced hit's time by stage, in wall and CPU time (bench/cold_hit.py).

The stages are issue 41's: the scheduler's lookup and load policy, the
connector metadata, the worker's plan, I/O issue and wait, verification,
copies, the host-to-device step, and vLLM's own share (its model forward and
the rest); plus the connector's other hooks (saves, finishing, stats), which
a partial hit pays for the blocks it computes.

    stage_table(trace, window)   one generate() call: per stage its wall ms
                                 (the request's thread, adds up to the TTFT),
                                 CPU ms (every thread) and wall ms on other
                                 threads
    summarise_stages(trace, timed)   the median prompt's table, every timed
                                 prompt's TTFT and process CPU
    ratio_keys(results)          the JSON's flat keys and targets: TTFT
                                 over the floor per token count and hit kind
    hits(results)                the same figures nested, with both rows'
                                 stage tables
    print_stages(columns)        the table

Each span (bench/harness/trace.py) counts exclusively: its own time less its
children's on the same thread, in the stage of its label (a label without
one takes its parent's; inside a save hook everything is the hook's: its
device-to-host copy is no host-to-device step). On the request's thread,
time in no span is vLLM's; where that thread waits in a load (WAITING: the
reader waiting for its chunks and verifiers, the loader for its layers)
while traced work runs on other threads, the wait counts in the stage of
that work (I/O first, then verification, copies, the plan). CPU is each
span's thread CPU (time.thread_time_ns), its children's taken out, summed
over threads; the request thread's CPU outside every span is vLLM's;
"untraced threads" is the process's CPU (/proc/self/task schedstat) less all
of that: vLLM's OpenMP threads, io_uring's workers, anything not wrapped.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import ratio, table

#: (key, title) of each stage, in the table's order
STAGES: list[tuple[str, str]] = [
    ("lookup", "scheduler: lookup and load policy"),
    ("metadata", "connector metadata (build, bind)"),
    ("plan", "worker: the load's plan"),
    ("io", "I/O: issue and wait"),
    ("verify", "verify (checksums)"),
    ("copies", "copies on the host"),
    ("h2d", "host-to-device (into the KV pages)"),
    ("hooks", "connector: other hooks (save, finish, stats)"),
    ("vllm_forward", "vLLM: model forward"),
    ("vllm", "vLLM: the rest (schedule, inputs, sample, outputs)"),
]
#: the process's CPU that no traced span holds
UNTRACED = "untraced"
#: what a trace's time is charged to when no label says
DEFAULT = "vllm"
#: the limit of the issue's target: a cold hit's TTFT over vLLM's own hit
TARGET_OVER_FLOOR = 1.5

_BY_STAGE: dict[str, list[str]] = {
    "lookup": [
        "conn.get_num_new_matched_tokens", "conn.update_state_after_alloc",
        "ours.match", "ours.keys", "ours.hit", "ours.decide", "ours.allocated",
        "store.lookup", "store.present", "index.lookup_prefix",
        "example.found_match",
    ],
    "metadata": [
        "conn.build_connector_meta", "conn.bind_connector_metadata",
        "conn.clear_connector_metadata", "ours.build_meta", "worker.bind",
    ],
    "plan": [
        "conn.start_load_kv", "worker.start_load", "loader.new_job", "loader.run",
        "loader.read_direct", "loader.load_layers", "store.read_many",
        "index.locate", "reader.read_chunks", "reader.read_rows",
        "reader.read_layers", "reader.plan", "files.residency",
        "native.cached_pages",
    ],
    "io": [
        "conn.wait_for_layer_load", "loader.wait_layer", "loader.settle",
        "loader.read_layer", "os.open", "os.posix_fadvise", "files.open_direct",
        "reader.engine", "route.engine", "route.cached", "route.streamed",
        "engine.submit", "engine.reap", "reader.header", "headers.get",
        "headers.prefetch", "parse_header", "store.readahead",
        "native.pread_layers_xxh3", "safetensors.load_file",
    ],
    "verify": ["verify.check_layer", "native.layer_checksums"],
    "copies": ["device.host_view"],
    "h2d": ["device.copy_runs", "example.inject (Tensor.__setitem__)", "memory.load"],
    "hooks": [
        "conn.save_kv_layer", "conn.wait_for_save", "conn.get_finished",
        "conn.get_block_ids_with_load_errors", "conn.build_connector_worker_meta",
        "conn.update_connector_output", "conn.get_kv_connector_stats",
        "conn.request_finished", "conn.request_finished_all_groups",
        "conn.handle_preemptions", "worker.finish_step",
    ],
    "vllm_forward": ["runner._model_forward"],
}  # fmt: skip
#: label -> stage; a label not here (vLLM's steps, os.makedirs, ...) takes
#: its parent's stage, vLLM's at the top
LABEL_STAGE: dict[str, str] = {
    label: stage for stage, labels in _BY_STAGE.items() for label in labels
}
#: the request thread's spans whose own time is mostly waiting for others
WAITING = {
    "conn.start_load_kv", "worker.start_load", "loader.run", "store.read_many",
    "reader.read_chunks", "reader.read_layers", "loader.load_layers",
    "loader.wait_layer", "loader.settle", "conn.wait_for_layer_load",
}  # fmt: skip
#: while the request thread waits, the other threads' stage it counts in
_PRIORITY = ["io", "verify", "copies", "h2d", "plan", "lookup", "metadata", "hooks"]

Segment = tuple[float, float, str, str]  # start, end, stage, label


def _exclusive(
    spans: list[tuple[str, float, float, int]], root: str
) -> tuple[list[Segment], list[tuple[str, float, float, float]]]:
    """One thread's spans (label, start, end, CPU ns), nested as calls are:
    the segments of time each span holds itself (start, end, stage, label),
    and per span (stage, start, end, own CPU ms)."""
    segments: list[Segment] = []
    owned: list[tuple[str, float, float, float]] = []
    # [label, stage, start, end, cpu, its children's cpu, own time emitted up to]
    stack: list[list[Any]] = []

    def close(entry: list[Any]) -> None:
        label, stage, start, end, cpu, child_cpu, cursor = entry
        if end > cursor:
            segments.append((cursor, end, stage, label))
        owned.append((stage, start, end, max(cpu - child_cpu, 0) / 1e6))
        if stack:
            stack[-1][5] += cpu
            stack[-1][6] = max(stack[-1][6], end)

    for label, start, end, cpu in sorted(spans, key=lambda s: (s[1], -s[2])):
        while stack and stack[-1][3] <= start:
            close(stack.pop())
        if stack:
            parent = stack[-1]
            if start > parent[6]:
                segments.append((parent[6], start, parent[1], parent[0]))
            end = min(end, parent[3])  # a clock's rounding: stay inside
            stage = LABEL_STAGE.get(label, parent[1])
            if parent[1] == "hooks":  # a save's copies and opens are the save's
                stage = "hooks"
        else:
            stage = LABEL_STAGE.get(label, root)
        stack.append([label, stage, start, end, cpu, 0, start])
    while stack:
        close(stack.pop())
    return segments, owned


def _main_thread(trace: dict[str, Any], window: dict[str, Any]) -> int:
    """The thread of the generate() call (older traces: the engine's)."""
    if "tid" in window:
        return int(window["tid"])
    steps: dict[int, int] = {}
    for span in trace["spans"]:
        if span[0] == "engine.step":
            steps[span[1]] = steps.get(span[1], 0) + 1
    return max(steps, key=steps.__getitem__) if steps else -1


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _waits(
    begin: float, end: float, others: list[tuple[float, float, str]]
) -> dict[str, float]:
    """A wait on the request thread from ``begin`` to ``end``: seconds per
    stage of the other threads' work meanwhile (the first of _PRIORITY that
    runs at each moment); the rest under ""."""
    active = [o for o in others if o[0] < end and o[1] > begin]
    cuts = sorted({begin, end, *(t for o in active for t in o[:2] if begin < t < end)})
    found: dict[str, float] = {}
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        running = {stage for s, e, stage in active if s < hi and e > lo}
        stage = next((p for p in _PRIORITY if p in running), "")
        found[stage] = found.get(stage, 0.0) + hi - lo
    return found


def stage_table(trace: dict[str, Any], window: dict[str, Any]) -> dict[str, Any]:
    """One generate() call by stage: ``{stage: {"wall_ms", "cpu_ms",
    "other_wall_ms"}}`` plus "total" (wall: the TTFT; CPU: the process's)."""
    t0, t1 = window["t0"], window["t1"]
    main = _main_thread(trace, window)
    by_thread: dict[int, list[tuple[str, float, float, int]]] = {}
    for span in trace["spans"]:
        label, tid, began, ended = span[0], span[1], span[2], span[3]
        if ended <= t0 or began >= t1:
            continue
        cpu = span[5] if len(span) > 5 else 0
        by_thread.setdefault(tid, []).append((label, began, ended, cpu))
    rows = {
        key: {"wall_ms": 0.0, "cpu_ms": 0.0, "other_wall_ms": 0.0}
        for key in [*(k for k, _ in STAGES), UNTRACED]
    }
    main_segments: list[Segment] = []
    others: list[tuple[float, float, str]] = []
    traced_cpu = main_span_cpu = 0.0
    for tid, spans in by_thread.items():
        segments, owned = _exclusive(spans, DEFAULT)
        for stage, start, end, cpu_ms in owned:
            share = _overlap(start, end, t0, t1) / (end - start) if end > start else 1.0
            rows[stage]["cpu_ms"] += cpu_ms * share
            traced_cpu += cpu_ms * share
            if tid == main:
                main_span_cpu += cpu_ms * share
        if tid == main:
            main_segments = segments
            continue
        for start, end, stage, _ in segments:
            rows[stage]["other_wall_ms"] += _overlap(start, end, t0, t1) * 1e3
            others.append((start, end, stage))
    held = 0.0
    for start, end, stage, label in main_segments:
        inside = _overlap(start, end, t0, t1)
        held += inside
        if label not in WAITING or not others:
            rows[stage]["wall_ms"] += inside * 1e3
            continue
        for waited_on, seconds in _waits(max(start, t0), min(end, t1), others).items():
            rows[waited_on or stage]["wall_ms"] += seconds * 1e3
    rows[DEFAULT]["wall_ms"] += max((t1 - t0) - held, 0.0) * 1e3
    main_cpu = float(window.get("main_cpu_ms", 0.0))
    process_cpu = float(window.get("process_cpu_ms", 0.0))
    main_outside = max(main_cpu - main_span_cpu, 0.0)  # generate()'s own, vLLM's
    rows[DEFAULT]["cpu_ms"] += main_outside
    rows[UNTRACED]["cpu_ms"] = max(process_cpu - traced_cpu - main_outside, 0.0)
    rows["total"] = {
        "wall_ms": (t1 - t0) * 1e3,
        "cpu_ms": process_cpu,
        "other_wall_ms": sum(r["other_wall_ms"] for r in rows.values()),
    }
    return {k: {f: round(v, 3) for f, v in r.items()} for k, r in rows.items()}


def summarise_stages(trace: dict[str, Any], timed: list[int]) -> dict[str, Any]:
    """The windows ``timed``: every prompt's TTFT and process CPU (ms), their
    medians, and the stage table of the prompt whose TTFT is the median (one
    prompt's stages add up; per-stage medians would mix prompts)."""
    windows = [trace["windows"][i] for i in timed]
    ttfts = [(w["t1"] - w["t0"]) * 1e3 for w in windows]
    cpus = [float(w.get("process_cpu_ms", 0.0)) for w in windows]
    middle = sorted(range(len(ttfts)), key=ttfts.__getitem__)[len(ttfts) // 2]
    return {
        "ttft_ms": [round(t, 3) for t in ttfts],
        "cpu_ms": [round(c, 3) for c in cpus],
        "ttft_median_ms": round(statistics.median(ttfts), 3),
        "cpu_median_ms": round(statistics.median(cpus), 3),
        "median_prompt": middle,
        "stages": stage_table(trace, windows[middle]),
    }


Results = dict[int, dict[str, dict[str, dict[str, Any]]]]


def ratio_keys(results: Results) -> tuple[dict[str, float], dict[str, Any]]:
    """``results[tokens][kind][row]`` (kind "full" or "partial"; rows "ours"
    and "floor", summarise_stages's): the flat keys (``ttft_ms_2000_full``,
    ``floor_ttft_ms_2000_full``, ``ttft_over_floor_2000_full``, ``cpu_ms_..``,
    ``floor_cpu_ms_..``, ``cpu_over_floor_..``) and the targets, TTFT over
    the floor <= TARGET_OVER_FLOOR per token count, full hits."""
    keys: dict[str, float] = {}
    targets: dict[str, Any] = {}
    for tokens, kinds in sorted(results.items()):
        for kind, rows in kinds.items():
            ours, floor = rows.get("ours"), rows.get("floor")
            if ours is None or floor is None:
                continue
            tag = f"{tokens}_{kind}"
            keys[f"ttft_ms_{tag}"] = ours["ttft_median_ms"]
            keys[f"floor_ttft_ms_{tag}"] = floor["ttft_median_ms"]
            over = round(ratio(ours["ttft_median_ms"], floor["ttft_median_ms"]), 3)
            keys[f"ttft_over_floor_{tag}"] = over
            keys[f"cpu_ms_{tag}"] = ours["cpu_median_ms"]
            keys[f"floor_cpu_ms_{tag}"] = floor["cpu_median_ms"]
            keys[f"cpu_over_floor_{tag}"] = round(
                ratio(ours["cpu_median_ms"], floor["cpu_median_ms"]), 3
            )
            if kind == "full":
                targets[f"ttft_over_floor_{tag}"] = {
                    "measured": over, "limit": TARGET_OVER_FLOOR,
                    "met": over <= TARGET_OVER_FLOOR,
                }  # fmt: skip
    return keys, targets


def hits(results: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """The JSON's ``hits[tokens][kind]``: ratio_keys's figures without the
    suffix, and both rows' stage tables (``stages``: ours, floor)."""
    keys, _ = ratio_keys(results)
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for tokens, kinds in sorted(results.items()):
        for kind, rows in kinds.items():
            tag = f"_{tokens}_{kind}"
            entry = {k[: -len(tag)]: v for k, v in keys.items() if k.endswith(tag)}
            entry["stages"] = {name: row["stages"] for name, row in rows.items()}
            found.setdefault(str(tokens), {})[kind] = entry
    return found


def print_stages(title: str, columns: dict[str, dict[str, Any]]) -> None:
    """Per stage and column: wall ms on the request's thread / CPU ms of every
    thread (wall ms of the stage's work on other threads in brackets)."""
    names = list(columns)
    rows: list[list[str]] = []
    titles = [*STAGES, (UNTRACED, "untraced threads (OpenMP, io_uring workers)")]
    for key, text in [*titles, ("total", "total (TTFT / process CPU)")]:
        cells = []
        for name in names:
            row = columns[name]["stages"].get(key)
            if row is None:
                cells.append("")
                continue
            cell = f"{row['wall_ms']:.2f} / {row['cpu_ms']:.2f}"
            if row["other_wall_ms"] >= 0.005 and key != "total":
                cell += f" ({row['other_wall_ms']:.2f})"
            cells.append(cell)
        if key == "vllm_forward":
            share = []
            for name in names:
                st = columns[name]["stages"]
                wall = st["vllm"]["wall_ms"] + st["vllm_forward"]["wall_ms"]
                cpu = st["vllm"]["cpu_ms"] + st["vllm_forward"]["cpu_ms"]
                share.append(f"{wall:.2f} / {cpu:.2f}")
            rows.append(["vLLM's own share", *share])
            text = "  " + text
        elif key == "vllm":
            text = "  " + text
        rows.append([text, *cells])
    head = f"{title}: stage (wall / CPU ms, median prompt; (other threads' wall))"
    print(table([head, *names], rows))
