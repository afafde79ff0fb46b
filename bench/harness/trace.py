"""The tracer of a cold hit, inside the traced vLLM process
(``python -m bench.harness.vllm_run run --trace FILE``; bench/cold_hit.py
reads what it writes).

    install()   wrap every target (bench/harness/trace_targets.py) before
                vLLM builds its engine; returns the Tracer
    Tracer      perf_counter spans of the wrapped calls per thread, with the
                thread's major page faults and CPU time (time.thread_time_ns
                at enter and exit); per generate() call a window with its
                thread, the process's disk reads, faults, CPU and CPU waits;
                dump(path)

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

from bench.harness.trace_targets import CONNECTORS, EXAMPLE, HOOKS, OS_CALLS, OURS, VLLM


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
    """perf_counter spans of the wrapped calls, per thread, with major faults
    and the thread's CPU time."""

    def __init__(self) -> None:
        # label, thread id, start, end, major faults of the thread meanwhile,
        # the thread's CPU nanoseconds meanwhile (its children's included)
        self.spans: list[tuple[str, int, float, float, int, int]] = []
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
        cpu = time.thread_time_ns
        local = self._local
        loading = label.endswith(".start_load_kv")
        per_thread = loading and os.environ.get("NPUKV_TRACE_THREADS") == "1"
        thread_cpu = self.thread_cpu

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = _threads_schedstat() if per_thread else {}
            faults = getrusage(thread).ru_majflt
            if loading:
                local.depth = getattr(local, "depth", 0) + 1
            cpu0 = cpu()
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ended = clock()
                cpu1 = cpu()
                if loading:
                    local.depth -= 1
                faults = getrusage(thread).ru_majflt - faults
                spans.append((label, ident(), began, ended, faults, cpu1 - cpu0))
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
                window["tid"] = threading.get_ident()
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
            cpu0 = time.thread_time_ns()
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
                        time.thread_time_ns() - cpu0,
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
    """Wrap every target (see VLLM, HOOKS, OURS, EXAMPLE, OS_CALLS); call before
    vLLM builds its engine. The caller dumps the tracer when done."""
    tracer = Tracer()
    for label, owner, attr in VLLM:
        tracer.wrap(label, owner, attr)
    for owner in CONNECTORS:
        for hook in HOOKS:
            try:
                cls = _resolve(owner)
            except (ImportError, AttributeError):
                tracer.missing.append(owner)
                break
            if hook in cls.__dict__:  # its own hooks, not the base class's
                tracer.wrap(f"conn.{hook}", owner, hook)
    for label, owner, attr in [*OURS, *EXAMPLE, *OS_CALLS]:
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
