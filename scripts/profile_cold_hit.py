"""Where a cold hit's time goes, in real vLLM, for our connector and for
vLLM's ExampleConnector, next to a hit that loads nothing (vLLM's prefix cache:
the floor) and a hit from host memory (scripts/memory_connector.py).

Same geometry as ``bench_vllm.py --quick`` (bench_vllm_runs.geometry): a
random-weight Llama (4 layers, hidden 256), 3 prompts of 1,000 tokens, every
row its own vLLM process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the page cache
dropped before the cold rows (the same settle and drop as the benchmark).

Non-invasive: the hit processes run ``vllm_harness.py run --trace FILE``,
which calls :func:`install` before vLLM starts. It wraps, at class or module
level, vLLM's steps (LLM.generate, add_request, EngineCore.step,
Scheduler.schedule / update_from_output, the KV cache manager, the model
runner's execute_model, _update_states, _zero_block_ids, _prepare_inputs,
_model_forward, sample_tokens, the output processor), every connector hook
(ours, ExampleConnector's, the memory connector's), our scheduler and worker
internals (SchedulerSide.match / _keys / _hit, KVStore.lookup / read_many,
LayerLoader, ChunkReader.read_chunks / read_rows / _header / _read_layers,
parse_header, the read routes, native.pread_layers_xxh3, the checksum
verification, the CPU backend's copy), ExampleConnector's safetensors
load_file and its copy into the KV cache (Tensor.__setitem__ inside
start_load_kv), and os.open / posix_fadvise / os.path.exists / os.makedirs.
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
starts every ChunkReader from those ReadTuning fields (A/B runs).

Run: ``python scripts/profile_cold_hit.py [--dir DIR] [--json PATH]
[--py-spy] [--warm]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# -- the tracer, in the traced vLLM process -----------------------------------------

#: (label, owner "module:Class" or "module", attribute): what install() wraps.
#: A target that does not exist (another vLLM, a refactored store) is skipped
#: and listed in the trace's "missing".
_VLLM = [
    ("generate", "vllm.entrypoints.llm:LLM", "generate"),
    ("llm.add_request", "vllm.v1.engine.llm_engine:LLMEngine", "add_request"),
    ("llm.step", "vllm.v1.engine.llm_engine:LLMEngine", "step"),
    ("engine.step", "vllm.v1.engine.core:EngineCore", "step"),
    ("engine.post_step", "vllm.v1.engine.core:EngineCore", "post_step"),
    ("sched.schedule", "vllm.v1.core.sched.scheduler:Scheduler", "schedule"),
    (
        "sched.update_from_output",
        "vllm.v1.core.sched.scheduler:Scheduler",
        "update_from_output",
    ),
    (
        "kvm.get_computed_blocks",
        "vllm.v1.core.kv_cache_manager:KVCacheManager",
        "get_computed_blocks",
    ),
    (
        "kvm.allocate_slots",
        "vllm.v1.core.kv_cache_manager:KVCacheManager",
        "allocate_slots",
    ),
    (
        "executor.execute_model",
        "vllm.v1.executor.uniproc_executor:UniProcExecutor",
        "execute_model",
    ),
    (
        "runner.execute_model",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "execute_model",
    ),
    (
        "runner._update_states",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_update_states",
    ),
    (
        "runner._zero_block_ids",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_zero_block_ids",
    ),
    (
        "runner._prepare_inputs",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_prepare_inputs",
    ),
    (
        "runner._build_attention_metadata",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_build_attention_metadata",
    ),
    (
        "runner._model_forward",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_model_forward",
    ),
    (
        "runner.sample_tokens",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "sample_tokens",
    ),
    (
        "output.process_outputs",
        "vllm.v1.engine.output_processor:OutputProcessor",
        "process_outputs",
    ),
]
_HOOKS = [
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
    "build_connector_worker_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "request_finished",
    "request_finished_all_groups",
]
_CONNECTORS = [
    "npukv_store.connector.connector:NPUKVStoreConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
    "memory_connector:MemoryConnector",
]
_OURS = [
    ("ours.match", "npukv_store.connector.scheduler:SchedulerSide", "match"),
    ("ours.keys", "npukv_store.connector.scheduler:SchedulerSide", "_keys"),
    ("ours.hit", "npukv_store.connector.scheduler:SchedulerSide", "_hit"),
    ("ours.decide", "npukv_store.connector.scheduler:SchedulerSide", "_decide"),
    ("ours.allocated", "npukv_store.connector.scheduler:SchedulerSide", "allocated"),
    ("ours.build_meta", "npukv_store.connector.scheduler:SchedulerSide", "build_meta"),
    ("store.lookup", "npukv_store.store.store:KVStore", "lookup"),
    ("store.present", "npukv_store.store.store:KVStore", "present"),
    ("store.readahead", "npukv_store.store.store:KVStore", "readahead"),
    ("store.read_many", "npukv_store.store.store:KVStore", "read_many"),
    ("index.lookup_prefix", "npukv_store.store.index:Index", "lookup_prefix"),
    ("index.locate", "npukv_store.store.index:Index", "locate"),
    ("worker.bind", "npukv_store.connector.worker:WorkerSide", "bind"),
    ("worker.start_load", "npukv_store.connector.worker:WorkerSide", "start_load"),
    ("worker.finish_step", "npukv_store.connector.worker:WorkerSide", "finish_step"),
    ("loader.new_job", "npukv_store.connector.loader:LayerLoader", "new_job"),
    ("loader.run", "npukv_store.connector.loader:LayerLoader", "run"),
    ("loader.read_direct", "npukv_store.connector.loader:LayerLoader", "_read_direct"),
    ("loader.load_layers", "npukv_store.connector.loader:LayerLoader", "_load_layers"),
    ("loader.read_layer", "npukv_store.connector.loader:LayerLoader", "_read_layer"),
    ("loader.wait_layer", "npukv_store.connector.loader:LayerLoader", "wait_layer"),
    ("loader.settle", "npukv_store.connector.loader:LayerLoader", "settle"),
    ("reader.read_chunks", "npukv_store.store.chunk_reader:ChunkReader", "read_chunks"),
    (
        "reader.load_headers",
        "npukv_store.store.chunk_reader:ChunkReader",
        "_load_headers",
    ),
    ("reader.read_rows", "npukv_store.store.chunk_reader:ChunkReader", "read_rows"),
    ("reader.header", "npukv_store.store.chunk_reader:ChunkReader", "_header"),
    ("headers.get", "npukv_store.store.chunk_headers:ChunkHeaders", "get"),
    ("headers.prefetch", "npukv_store.store.chunk_headers:ChunkHeaders", "prefetch"),
    ("parse_header", "npukv_store.store.chunk_headers", "parse_header"),
    (
        "reader.read_layers",
        "npukv_store.store.chunk_reader:ChunkReader",
        "_read_layers",
    ),
    ("reader.plan", "npukv_store.store.chunk_reader:ChunkReader", "_plan"),
    ("route.cached", "npukv_store.store.chunk_reader", "read_cached"),
    ("route.streamed", "npukv_store.store.chunk_reader", "read_streamed"),
    ("route.engine", "npukv_store.store.chunk_reader", "read_by_engine"),
    ("files.residency", "npukv_store.store.read_routes:ChunkFiles", "residency"),
    ("files.open_direct", "npukv_store.store.read_routes:ChunkFiles", "open_direct"),
    ("verify.check_layer", "npukv_store.store.read_routes:ChunkRead", "check_layer"),
    ("native.pread_layers_xxh3", "npukv_store.native", "pread_layers_xxh3"),
    ("engine.submit", "npukv_store.io.uring:UringEngine", "submit"),
    ("engine.reap", "npukv_store.io.uring:UringEngine", "reap"),
    ("reader.engine", "npukv_store.store.chunk_reader:ChunkReader", "_engine"),
    ("native.cached_pages", "npukv_store.native", "cached_pages"),
    ("native.layer_checksums", "npukv_store.store.read_routes", "layer_checksums"),
    ("device.copy_runs", "npukv_store.device.cpu:CpuBackend", "copy_runs"),
    ("device.host_view", "npukv_store.device.cpu:CpuBackend", "host_view"),
]
_EXAMPLE = [
    (
        "example.found_match",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
        "_found_match_for_request",
    ),
    (
        "example.filename",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
        "_generate_filename_debug",
    ),
    ("safetensors.load_file", "safetensors.torch", "load_file"),
    ("memory.load", "memory_connector:MemoryConnector", "_load"),
]
_OS = [
    ("os.open", "os", "open"),
    ("os.posix_fadvise", "os", "posix_fadvise"),
    ("os.path.exists", "os.path", "exists"),
    ("os.makedirs", "os", "makedirs"),
]


def _resolve(owner: str) -> Any:
    import importlib

    module_name, _, class_name = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in class_name.split(".") if class_name else []:
        obj = getattr(obj, part)
    return obj


def _read_bytes() -> int:
    """Bytes this process has had read from storage (/proc/self/io)."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _schedstat(path: str) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of a task."""
    try:
        with open(path, "rb") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return 0, 0


def _process_schedstat() -> tuple[int, int]:
    """_schedstat summed over this process's threads."""
    on_cpu = waiting = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0, 0
    for task in tasks:
        run, wait = _schedstat(f"/proc/self/task/{task}/schedstat")
        on_cpu += run
        waiting += wait
    return on_cpu, waiting


def _threads_schedstat() -> dict[str, tuple[str, int, int]]:
    """Per thread of this process: (name, ns on a CPU, ns waiting for one)."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        found[task] = (name, *_schedstat(f"/proc/self/task/{task}/schedstat"))
    return found


def _psi_cpu_us() -> int:
    """Microseconds some task of the machine waited for a CPU (PSI)."""
    try:
        with open("/proc/pressure/cpu", "rb") as f:
            first = f.readline().split()
        return int(first[-1].split(b"=")[1])
    except (OSError, IndexError, ValueError):
        return -1


def _steal_ticks() -> int:
    """The machine's stolen CPU time (hypervisor), in clock ticks."""
    try:
        with open("/proc/stat", "rb") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return -1


def _contention() -> dict[str, float]:
    """Counters whose deltas over a generate() call say how much of it was
    spent waiting for a CPU rather than working or waiting for the disk."""
    main_cpu, main_wait = _schedstat("/proc/thread-self/schedstat")
    proc_cpu, proc_wait = _process_schedstat()
    return {
        "main_cpu_ms": main_cpu / 1e6,
        "main_runqueue_ms": main_wait / 1e6,
        "process_cpu_ms": proc_cpu / 1e6,
        "process_runqueue_ms": proc_wait / 1e6,
        "psi_cpu_some_ms": _psi_cpu_us() / 1e3,
        "steal_ms": _steal_ticks() * 1e3 / os.sysconf("SC_CLK_TCK"),
        "read_bytes": _read_bytes(),
        "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
        "nivcsw": resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw,
    }


class Tracer:
    """perf_counter spans of the wrapped calls, per thread, with major faults."""

    def __init__(self) -> None:
        # label, thread id, start, end, major faults of the thread meanwhile
        self.spans: list[tuple[str, int, float, float, int]] = []
        # generate() calls: start, end, process read_bytes and major faults
        self.windows: list[dict[str, float]] = []
        self.wrapped: list[str] = []
        self.missing: list[str] = []
        # NPUKV_TRACE_THREADS=1: each start_load_kv's CPU and run-queue ms per
        # thread (snapshots outside its span; they lengthen the generate() call)
        self.thread_cpu: list[dict[str, Any]] = []
        self._local = threading.local()  # depth inside a connector's start_load_kv

    def wrap(self, label: str, owner: str, attr: str) -> None:
        import inspect

        try:
            target = _resolve(owner)
            raw = inspect.getattr_static(target, attr)
        except (ImportError, AttributeError):
            self.missing.append(f"{label} ({owner}.{attr})")
            return
        if isinstance(raw, staticmethod | classmethod):
            wrapper: Any = type(raw)(self._span(label, raw.__func__))
        elif label == "generate":
            wrapper = self._window(raw)
        else:
            wrapper = self._span(label, raw)
        setattr(target, attr, wrapper)
        self.wrapped.append(label)

    def _span(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spans = self.spans
        getrusage, thread = resource.getrusage, resource.RUSAGE_THREAD
        clock, ident = time.perf_counter, threading.get_ident
        local = self._local
        loading = label.endswith(".start_load_kv")
        per_thread = loading and os.environ.get("NPUKV_TRACE_THREADS") == "1"
        thread_cpu = self.thread_cpu

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = _threads_schedstat() if per_thread else {}
            faults = getrusage(thread).ru_majflt
            if loading:
                local.depth = getattr(local, "depth", 0) + 1
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ended = clock()
                if loading:
                    local.depth -= 1
                faults = getrusage(thread).ru_majflt - faults
                spans.append((label, ident(), began, ended, faults))
                if per_thread:
                    after = _threads_schedstat()
                    thread_cpu.append(
                        {
                            "t0": began,
                            "t1": ended,
                            "threads": {
                                f"{tid} {after[tid][0]}": [
                                    round((after[tid][1] - before[tid][1]) / 1e6, 3),
                                    round((after[tid][2] - before[tid][2]) / 1e6, 3),
                                ]
                                for tid in after
                                if tid in before and after[tid][1] > before[tid][1]
                            },
                        }
                    )

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _window(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        windows = self.windows

        def generate(*args: Any, **kwargs: Any) -> Any:
            before = _contention()  # read outside the timed span
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                after = _contention()
                window = {k: after[k] - before[k] for k in before}
                window["t0"], window["t1"] = began, ended
                windows.append(window)

        return generate

    def wrap_setitem(self) -> None:
        """Tensor.__setitem__, counted only inside a start_load_kv (the
        ExampleConnector's copy into the KV cache)."""
        import torch

        spans, local = self.spans, self._local
        original = torch.Tensor.__setitem__
        getrusage, thread = resource.getrusage, resource.RUSAGE_THREAD

        def setitem(tensor: Any, index: Any, value: Any) -> None:
            if not getattr(local, "depth", 0):
                return original(tensor, index, value)  # type: ignore[no-any-return]
            faults = getrusage(thread).ru_majflt
            began = time.perf_counter()
            try:
                return original(tensor, index, value)  # type: ignore[no-any-return]
            finally:
                spans.append(
                    (
                        "example.inject (Tensor.__setitem__)",
                        threading.get_ident(),
                        began,
                        time.perf_counter(),
                        getrusage(thread).ru_majflt - faults,
                    )
                )

        torch.Tensor.__setitem__ = setitem  # type: ignore[method-assign,assignment]
        self.wrapped.append("example.inject")

    def dump(self, path: str, extra: dict[str, Any] | None = None) -> None:
        with open(path, "w") as f:
            json.dump(
                {
                    "spans": self.spans,
                    "windows": self.windows,
                    "wrapped": self.wrapped,
                    "thread_cpu": self.thread_cpu,
                    "missing": self.missing,
                    "threads": {
                        t.ident: t.name for t in threading.enumerate() if t.ident
                    },
                    **(extra or {}),
                },
                f,
            )


def install() -> Tracer:
    """Wrap every target (see _VLLM, _HOOKS, _OURS, _EXAMPLE, _OS); call before
    vLLM builds its engine. The caller dumps the tracer when done."""
    tracer = Tracer()
    for label, owner, attr in _VLLM:
        tracer.wrap(label, owner, attr)
    for owner in _CONNECTORS:
        for hook in _HOOKS:
            try:
                cls = _resolve(owner)
            except (ImportError, AttributeError):
                tracer.missing.append(owner)
                break
            if hook in cls.__dict__:  # its own hooks, not the base class's
                tracer.wrap(f"conn.{hook}", owner, hook)
    for label, owner, attr in [*_OURS, *_EXAMPLE, *_OS]:
        tracer.wrap(label, owner, attr)
    tracer.wrap_setitem()
    _read_tuning_override()
    return tracer


def _read_tuning_override() -> None:
    """A/B knob: NPUKV_PROFILE_READ_TUNING='{"verify_threads": 1}' makes every
    ChunkReader of this process start from those ReadTuning fields (the store
    has no configuration key for them)."""
    fields = json.loads(os.environ.get("NPUKV_PROFILE_READ_TUNING") or "{}")
    if not fields:
        return
    from npukv_store.store import chunk_reader

    original = chunk_reader.ReadTuning

    def tuning(**kwargs: Any) -> Any:
        return original(**{**fields, **kwargs})

    chunk_reader.ReadTuning = tuning  # type: ignore[assignment,misc]


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
    width = 52
    print(f"{'phase (ms; the median prompt; [f]: major faults)':<{width}}", end="")
    for name in names:
        print(f"{name:>15}", end="")
    print()
    derived = {base: (title, indent) for title, indent, base, _ in DERIVED}
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
            if not any(cells):
                continue
            print(f"{'  ' * ind + text:<{width}}", end="")
            for cell in cells:
                print(f"{cell:>15}", end="")
            print()
    for key, title in (
        ("main_runqueue_ms", "main thread waiting for a CPU"),
        ("process_runqueue_ms", "all threads waiting for a CPU"),
        ("psi_cpu_some_ms", "machine: some task waiting (PSI)"),
    ):
        print(f"{title:<{width}}", end="")
        for name in names:
            column = columns[name]
            value = column["contention"][key][column["median_prompt"]]
            print(f"{value:>15.2f}", end="")
        print()
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
    bench: Any, geo: Any, name: str, args: list[str], **kw: Any
) -> dict[str, Any]:
    trace = geo.work / f"{name}.trace.json"
    report = bench.harness(geo.work, name, [*args, "--trace", str(trace)], **kw)
    data: dict[str, Any] = json.loads(trace.read_text())
    data["report"] = report
    return data


def _py_spy(bench: Any, geo: Any, name: str, args: list[str]) -> Path:
    """One more cold hit of ours under py-spy, recorded only while its timed
    prompts run (the harness pauses after its warm-up until told to go)."""
    gate = geo.work / f"{name}.gate"
    shutil.rmtree(gate, ignore_errors=True)
    gate.mkdir()
    out = geo.work / f"{name}.pyspy.txt"
    env = dict(
        os.environ, PYTHONPATH=str(bench.ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0"
    )
    cmd = [
        sys.executable, bench.HARNESS, "run", "--out", str(geo.work / f"{name}.json"),
        *args, "--pause-after-warmup", str(gate),
    ]  # fmt: skip
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="", help="work directory (default: tmp)")
    parser.add_argument("--json", default="", help="write the summaries here")
    parser.add_argument("--py-spy", action="store_true", help="also py-spy a cold hit")
    parser.add_argument("--warm", action="store_true", help="also trace warm hits")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_vllm_runs as bench

    geo = bench.geometry(Path(args.dir) if args.dir else None, quick=True)
    for stale in ("ours_cache", "example"):
        shutil.rmtree(geo.work / stale, ignore_errors=True)

    def cold(kv: Path) -> None:  # the benchmark's cold treatment
        bench.settle_after_writes()
        bench.drop_page_cache(kv)

    n = geo.num_prompts
    columns: dict[str, dict[str, Any]] = {}
    traces: dict[str, dict[str, Any]] = {}
    traces["floor"] = _traced(bench, geo, "floor", geo.floor)
    traces["memory"] = _traced(bench, geo, "memory", geo.memory)
    bench.harness(geo.work, "ours_store", [*geo.ttft, *geo.ours("ours_cache")])
    cold(geo.work / "ours_cache")
    raw_s, raw_bytes = bench.raw_cold_read(geo.work / "ours_cache")
    cold(geo.work / "ours_cache")
    ours = [*geo.ttft, *geo.ours("ours_cache")]
    traces["ours cold"] = _traced(bench, geo, "ours_hit", ours)
    if args.warm:
        traces["ours warm"] = _traced(bench, geo, "ours_hit_warm", ours)
    bench.harness(geo.work, "example_store", [*geo.ttft, *geo.example])
    cold(geo.work / "example")
    example = [*geo.ttft, *geo.example]
    traces["Example cold"] = _traced(bench, geo, "example_hit", example)
    if args.warm:
        traces["Example warm"] = _traced(bench, geo, "example_hit_warm", example)
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
    result: dict[str, Any] = {
        "columns": columns,
        "raw_cold_read_s": raw_s,
        "raw_cold_read_bytes": raw_bytes,
        "raw_per_prompt_ms": raw_per_prompt * 1e3,
    }
    if args.py_spy:
        cold(geo.work / "ours_cache")
        spy = _py_spy(bench, geo, "ours_hit_spy", ours)
        result["py_spy"] = summary = summarise_py_spy(spy)
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
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
