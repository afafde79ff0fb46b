"""The tracer of a cold hit, inside the traced vLLM process
(``python -m bench.harness.vllm_run run --trace FILE``; bench/cold_hit.py
reads what it writes).

    install()   wrap every target (_VLLM, _HOOKS on each connector, _OURS,
                _EXAMPLE, _OS) before vLLM builds its engine; returns the Tracer
    Tracer      perf_counter spans of the wrapped calls per thread, with the
                thread's major page faults; per generate() call a window with
                the process's disk reads, faults and CPU waits; dump(path)

Non-invasive: it wraps, at class or module level, vLLM's steps (LLM.generate,
add_request, EngineCore.step, Scheduler.schedule / update_from_output, the KV
cache manager, the model runner's execute_model, _update_states,
_zero_block_ids, _prepare_inputs, _model_forward, sample_tokens, the output
processor), every connector hook (ours, ExampleConnector's, the memory
connector's), our scheduler and worker internals, ExampleConnector's
safetensors load_file and its copy into the KV cache (Tensor.__setitem__
inside start_load_kv), and os.open / posix_fadvise / os.path.exists /
os.makedirs. A target that does not exist (another vLLM, a refactored store)
is skipped and listed in the trace's "missing".

Two environment knobs: NPUKV_TRACE_THREADS=1 keeps, for each start_load_kv,
every thread's CPU and run-queue milliseconds; NPUKV_PROFILE_READ_TUNING=
'{"verify_threads": 2}' starts every ChunkReader from those ReadTuning fields.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

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
    "bench.harness.memory_connector:MemoryConnector",
]
_OURS = [
    ("ours.match", "npukv_store.connector.scheduler.side:SchedulerSide", "match"),
    ("ours.keys", "npukv_store.connector.scheduler.side:SchedulerSide", "_keys"),
    ("ours.hit", "npukv_store.connector.scheduler.side:SchedulerSide", "_hit"),
    ("ours.decide", "npukv_store.connector.scheduler.side:SchedulerSide", "_decide"),
    (
        "ours.allocated",
        "npukv_store.connector.scheduler.side:SchedulerSide",
        "allocated",
    ),
    (
        "ours.build_meta",
        "npukv_store.connector.scheduler.side:SchedulerSide",
        "build_meta",
    ),
    ("store.lookup", "npukv_store.store.store:KVStore", "lookup"),
    ("store.present", "npukv_store.store.store:KVStore", "present"),
    ("store.readahead", "npukv_store.store.store:KVStore", "readahead"),
    ("store.read_many", "npukv_store.store.store:KVStore", "read_many"),
    ("index.lookup_prefix", "npukv_store.store.index:Index", "lookup_prefix"),
    ("index.locate", "npukv_store.store.index:Index", "locate"),
    ("worker.bind", "npukv_store.connector.worker.side:WorkerSide", "bind"),
    ("worker.start_load", "npukv_store.connector.worker.side:WorkerSide", "start_load"),
    (
        "worker.finish_step",
        "npukv_store.connector.worker.side:WorkerSide",
        "finish_step",
    ),
    ("loader.new_job", "npukv_store.connector.worker.loader:LayerLoader", "new_job"),
    ("loader.run", "npukv_store.connector.worker.loader:LayerLoader", "run"),
    (
        "loader.read_direct",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_read_direct",
    ),
    (
        "loader.load_layers",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_load_layers",
    ),
    (
        "loader.read_layer",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_read_layer",
    ),
    (
        "loader.wait_layer",
        "npukv_store.connector.worker.loader:LayerLoader",
        "wait_layer",
    ),
    ("loader.settle", "npukv_store.connector.worker.loader:LayerLoader", "settle"),
    ("reader.read_chunks", "npukv_store.store.read.reader:ChunkReader", "read_chunks"),
    ("reader.read_rows", "npukv_store.store.read.reader:ChunkReader", "read_rows"),
    ("reader.header", "npukv_store.store.read.reader:ChunkReader", "_header"),
    ("headers.get", "npukv_store.store.read.headers:ChunkHeaders", "get"),
    ("headers.prefetch", "npukv_store.store.read.headers:ChunkHeaders", "prefetch"),
    ("parse_header", "npukv_store.store.read.headers", "parse_header"),
    (
        "reader.read_layers",
        "npukv_store.store.read.reader:ChunkReader",
        "_read_layers",
    ),
    ("reader.plan", "npukv_store.store.read.reader:ChunkReader", "_plan"),
    ("route.cached", "npukv_store.store.read.reader", "read_cached"),
    ("route.streamed", "npukv_store.store.read.reader", "read_streamed"),
    ("route.engine", "npukv_store.store.read.reader", "read_by_engine"),
    ("files.residency", "npukv_store.store.read.routes:ChunkFiles", "residency"),
    ("files.open_direct", "npukv_store.store.read.routes:ChunkFiles", "open_direct"),
    ("verify.check_layer", "npukv_store.store.read.routes:ChunkRead", "check_layer"),
    ("native.pread_layers_xxh3", "npukv_store.native", "pread_layers_xxh3"),
    ("engine.submit", "npukv_store.io.uring:UringEngine", "submit"),
    ("engine.reap", "npukv_store.io.uring:UringEngine", "reap"),
    ("reader.engine", "npukv_store.store.read.reader:ChunkReader", "_engine"),
    ("native.cached_pages", "npukv_store.native", "cached_pages"),
    ("native.layer_checksums", "npukv_store.store.read.routes", "layer_checksums"),
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
    ("memory.load", "bench.harness.memory_connector:MemoryConnector", "_load"),
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
    from npukv_store.store.read import reader as chunk_reader

    original = chunk_reader.ReadTuning

    def tuning(**kwargs: Any) -> Any:
        return original(**{**fields, **kwargs})

    chunk_reader.ReadTuning = tuning  # type: ignore[assignment,misc]
