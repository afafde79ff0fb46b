"""Device check on a CUDA machine via npukv_store.device (docs/device.md §1.4).

A 1 GiB staging ring (npukv_store.io.ring.StagingRing on /dev/shm) is registered in
place with the backend. Two KV caches are built on the GPU, ``--layers`` layers
each: Ascend-style ``(k, v)`` tuples of ``[B, N, H, D]`` and vLLM's fused
``[B, H, N, 2D]``. For each, ``--blocks`` random blocks go D2H into ring rows and
come back H2D into as many other blocks, along three paths:

  batch     backend.copy_runs of the runs
            npukv_store.connector.worker.block_runs.build_runs computes
            (vLLM's swap_blocks_batch if vLLM is loaded, else the C extension's
            cuMemcpyBatchAsync, one call for all runs): what the connector uses
  loop      the C extension's cudaMemcpyAsync per run (``batch_api=False``),
            what copy_runs did before the batch call; for comparison
  per-page  one ``copy_(non_blocking=True)`` per page under stream_ctx: the
            portable baseline of the GB/s ratio

A pinning probe first copies 64 MiB each way between the GPU and four kinds of
host memory (torch pin_memory, a registered anonymous mapping, the registered
shm ring, pageable numpy) behind a GPU sleep: registered memory must not block.

Each pass follows the ordering protocol (npukv_store.device.ordering) behind a
GPU sleep of ``--sleep-ms`` on the compute stream that then rewrites the source
blocks (D2H) or zeroes the destination blocks (H2D): the byte checks fail if a
copy overtakes the compute stream. The host did not block if, when enqueueing
returned, the event recorded after the sleep had not completed yet (the copies
were queued behind the sleep, not waited for); the sleep is calibrated with the
clocks already raised, and its measured length is reported. Then ``--repeat``
timed passes per path give GB/s (CUDA events on the transfer stream; the median
is reported) and the host's enqueue time per run with the GPU idle.

Run: ``python -m bench device_check [--quick] [--json PATH] [--blocks 256]
[--repeat 5]`` (``--quick``: 64 blocks, 2 timed passes, unless given);
``--device cpu`` dry-runs the same steps on the CPU backend (no sleep, no
blocking verdict). The C extension must be built (``python setup.py build_ext
--inplace``). Exit 0: every check passed, or no CUDA device (said so); 1: a check
failed; 2: the setup is incomplete (message says what). The JSON (``status``,
``cases``, ...) follows the report header (bench/report.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.report import Report, table

MIB = 1 << 20


@dataclass
class Case:
    layout: str
    direction: str
    path: str
    bytes: int
    runs: int
    gbps: float = 0.0
    enqueue_ms: float = 0.0
    done_ms: float = 0.0
    sleep_ms: float = 0.0  # measured length of the GPU sleep in the ordered pass
    enqueue_us_per_run: float = 0.0  # host time per run, GPU idle (timed passes)
    host_blocked: bool | None = None
    bytes_ok: bool = False
    ratio: float | None = None  # batch GB/s / per-page GB/s


def make_caches(torch: Any, kind: str, args: argparse.Namespace, dev: Any) -> list:
    """Per layer: a (k, v) tuple of [B, N, H, D] or one fused [B, H, N, 2D]."""
    b, n, h, d = args.num_blocks, args.block_size, args.heads, args.head_dim
    if kind == "tuple":
        return [
            tuple(
                torch.empty(b, n, h, d, dtype=torch.bfloat16, device=dev) for _ in "kv"
            )
            for _ in range(args.layers)
        ]
    return [
        torch.empty(b, h, n, 2 * d, dtype=torch.bfloat16, device=dev)
        for _ in range(args.layers)
    ]


def block_bytes(torch: Any, layers: list) -> list:
    """[num_blocks, page] uint8 views of every tensor, in page (segment) order."""
    tensors = [t for kv in layers for t in (kv if isinstance(kv, tuple) else (kv,))]
    return [t.view(torch.uint8).reshape(t.shape[0], -1) for t in tensors]


class Check:
    """One layout's buffers and runs, and the passes over them."""

    def __init__(self, torch, backend, ordering, ring, layers, args, rng) -> None:
        from npukv_store.connector.worker.block_runs import build_runs
        from npukv_store.connector.worker.pages import describe_layer

        self.torch, self.backend, self.ordering = torch, backend, ordering
        self.args = args
        self.pages = block_bytes(torch, layers)
        found = [
            describe_layer(f"l{i}", kv, args.num_blocks) for i, kv in enumerate(layers)
        ]
        layouts = [lay for lay in found if lay is not None]
        assert len(layouts) == len(found), "a layer without a layout"
        assert sum(len(lay.segments) for lay in layouts) == len(self.pages), (
            "one run/page"
        )
        self.page_sum = sum(lay.page_bytes for lay in layouts)
        self.row = -(-self.page_sum // 4096) * 4096
        if args.blocks * self.row > ring.size:
            raise SystemExit(
                f"setup: {args.blocks} rows of {self.row} B exceed the ring"
            )
        picks = rng.choice(args.num_blocks, 2 * args.blocks, replace=False)
        self.src_blocks, self.dst_blocks = picks[: args.blocks], picks[args.blocks :]
        self.slots = rng.permutation(args.blocks)
        self.ring, self.base = ring, int(ring.data.ctypes.data)
        self.ring_t = torch.from_numpy(ring.data)
        self.d2h = build_runs(layouts, self.src_blocks, self.slots, self.base, self.row)
        fwd = build_runs(layouts, self.dst_blocks, self.slots, self.base, self.row)
        self.h2d = (fwd[1], fwd[0], fwd[2])
        self.xfer = backend.new_stream()
        dev = self.pages[0].device
        self.src_idx = torch.as_tensor(self.src_blocks, device=dev)
        self.dst_idx = torch.as_tensor(self.dst_blocks, device=dev)
        self.fresh = [
            torch.empty(args.blocks, p.shape[1], dtype=torch.uint8, device=dev)
            for p in self.pages
        ]

    def _compute_then(self, direction: str, sleep_cycles: int) -> tuple[Any, Any]:
        """Busy the compute stream, then rewrite sources / zero destinations;
        returns timing events recorded before and after the sleep."""
        slept_from = self.backend.new_event(timing=True)
        slept_to = self.backend.new_event(timing=True)
        slept_from.record(self.backend.current_stream())
        if sleep_cycles:
            self.torch.cuda._sleep(sleep_cycles)
        slept_to.record(self.backend.current_stream())
        # In-place ops on buffers allocated up front: an allocation here could
        # synchronise the host with the sleep and void the blocking verdict.
        for page, fresh in zip(self.pages, self.fresh, strict=True):
            if direction == "d2h":
                fresh.random_(0, 256)
                page.index_copy_(0, self.src_idx, fresh)
            else:
                page.index_fill_(0, self.dst_idx, 0)
        return slept_from, slept_to

    def _enqueue(self, direction: str, path: str) -> Any:
        b, o = self.backend, self.ordering
        if path == "batch" and direction == "d2h":
            return o.d2h_after(b, o.record_written(b), self.xfer, *self.d2h)
        if path == "batch":
            return o.h2d_after(b, b.current_stream(), self.xfer, *self.h2d)
        if path == "loop":  # what copy_runs did before cuMemcpyBatchAsync
            from npukv_store import native

            if direction == "d2h":
                self.xfer.wait_event(o.record_written(b))
                src, dst, size = self.d2h
            else:
                self.xfer.wait_stream(b.current_stream())
                src, dst, size = self.h2d
            kind = 2 if direction == "d2h" else 1
            native.cuda_memcpy_batch(
                src, dst, size, kind, self.xfer.raw_handle(), False
            )
            done = b.new_event()
            done.record(self.xfer)
            return done
        if direction == "d2h":
            self.xfer.wait_event(o.record_written(b))
        else:
            self.xfer.wait_stream(b.current_stream())
        with b.stream_ctx(self.xfer):
            blocks = self.src_blocks if direction == "d2h" else self.dst_blocks
            for block, slot in zip(blocks.tolist(), self.slots.tolist(), strict=True):
                offset = slot * self.row
                for page in self.pages:
                    host = self.ring_t[offset : offset + page.shape[1]]
                    if direction == "d2h":
                        host.copy_(page[block], non_blocking=True)
                    else:
                        page[block].copy_(host, non_blocking=True)
                    offset += page.shape[1]
        done = b.new_event()
        done.record(self.xfer)
        return done

    def bytes_ok(self, direction: str) -> bool:
        if direction == "h2d":
            return all(
                self.torch.equal(p[self.dst_idx], p[self.src_idx]) for p in self.pages
            )
        expected = self.torch.cat([p[self.src_idx] for p in self.pages], dim=1).cpu()
        rows = self.ring.data[: self.args.blocks * self.row].reshape(-1, self.row)
        return bool(np.array_equal(rows[self.slots, : self.page_sum], expected.numpy()))

    def run(self, direction: str, path: str, sleep_ms: float, cycles: int) -> Case:
        runs = self.d2h if direction == "d2h" else self.h2d
        case = Case("", direction, path, self.args.blocks * self.page_sum, len(runs[2]))
        self.backend.synchronize()
        slept_from, slept_to = self._compute_then(direction, cycles)
        start = time.perf_counter()
        done = self._enqueue(direction, path)
        case.enqueue_ms = (time.perf_counter() - start) * 1e3
        still_sleeping = not slept_to.query()
        done.synchronize()
        case.done_ms = (time.perf_counter() - start) * 1e3
        case.bytes_ok = self.bytes_ok(direction)
        if cycles:
            case.host_blocked = not still_sleeping
            case.sleep_ms = slept_from.elapsed_ms(slept_to)
        case.gbps, enqueue_s = self._bandwidth(direction, path)
        case.enqueue_us_per_run = enqueue_s / case.runs * 1e6
        return case

    def _bandwidth(self, direction: str, path: str) -> tuple[float, float]:
        """Median (GB/s, host enqueue seconds) over the timed passes."""
        nbytes, rates, enqueues = self.args.blocks * self.page_sum, [], []
        for _ in range(self.args.repeat):
            self.backend.synchronize()
            start_ev = self.backend.new_event(timing=True)
            end_ev = self.backend.new_event(timing=True)
            start_ev.record(self.xfer)
            t0 = time.perf_counter()
            self._enqueue(direction, path)
            enqueues.append(time.perf_counter() - t0)
            end_ev.record(self.xfer)
            end_ev.synchronize()
            seconds = time.perf_counter() - t0
            if hasattr(start_ev, "elapsed_ms"):
                seconds = start_ev.elapsed_ms(end_ev) / 1e3
            rates.append(nbytes / seconds / 1e9)
        return statistics.median(rates), statistics.median(enqueues)


def sleep_cycles(torch: Any, backend: Any, sleep_ms: float) -> int:
    """torch.cuda._sleep cycles lasting about ``sleep_ms`` (0: no sleep here)."""
    if backend.kind != "cuda" or not hasattr(torch.cuda, "_sleep") or sleep_ms <= 0:
        return 0
    probe = 50_000_000
    # An idle GPU clocks low (345 MHz against 1980 MHz seen on an H200), so the
    # first probe runs long; the fastest of several, clocks raised, is the rate.
    fastest = float("inf")
    for _ in range(4):
        start, end = backend.new_event(timing=True), backend.new_event(timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        fastest = min(fastest, start.elapsed_ms(end))
    return int(probe * sleep_ms / max(fastest, 1e-3))


def pinning_probe(torch: Any, backend: Any, ring: Any, cycles: int) -> dict:
    """Does a copy between the GPU and each kind of host buffer return to the
    host at once, or wait for the stream's earlier work (what the driver does
    for pageable memory: D2H returns when the copy is done)? 64 MiB each way,
    behind a GPU sleep on the compute stream, through torch's copy_ and the
    backend's copy_runs. Returns {buffer: {path direction: enqueue ms, and
    whether the sleep was still running when it returned}}."""
    import mmap

    nbytes = 64 * MIB
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    anon = mmap.mmap(-1, nbytes)
    anon_np = np.frombuffer(anon, dtype=np.uint8)
    anon_region = backend.register_host(int(anon_np.ctypes.data), nbytes)
    hosts = {
        "torch pin_memory": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "anon mmap, registered": torch.from_numpy(anon_np),
        "shm ring, registered": torch.from_numpy(ring.data[:nbytes]),
        "pageable numpy": torch.from_numpy(np.empty(nbytes, dtype=np.uint8)),
    }
    xfer = backend.new_stream()
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, host in hosts.items():
            row: dict[str, Any] = {"is_pinned": bool(host.is_pinned())}
            for path in ("copy_", "copy_runs"):
                for direction in ("d2h", "h2d"):
                    backend.synchronize()
                    torch.cuda._sleep(cycles)
                    slept = backend.new_event()
                    slept.record(backend.current_stream())
                    start = time.perf_counter()
                    xfer.wait_event(slept)
                    src, dst = (device_buf, host) if direction == "d2h" else (
                        host, device_buf)  # fmt: skip
                    if path == "copy_":
                        with backend.stream_ctx(xfer):
                            dst.copy_(src, non_blocking=True)
                    else:
                        backend.copy_runs(
                            np.array([src.data_ptr()], dtype=np.int64),
                            np.array([dst.data_ptr()], dtype=np.int64),
                            np.array([nbytes], dtype=np.int64), direction, xfer,
                        )  # fmt: skip
                    enqueue_ms = (time.perf_counter() - start) * 1e3
                    row[f"{path} {direction}"] = {
                        "enqueue_ms": round(enqueue_ms, 2),
                        "returned_during_sleep": not slept.query(),
                    }
                    backend.synchronize()
            out[name] = row
    finally:
        anon_region.close()  # the mapping itself goes with the last view of it
    return out


def open_ring(size: int, directory: str) -> Any:
    from npukv_store.errors import ConfigError
    from npukv_store.io.ring import StagingRing

    try:
        return StagingRing(size, directory=directory)
    except ConfigError as exc:  # a container's /dev/shm is often 64 MiB
        print(f"note: {exc}; using {tempfile.gettempdir()} instead")
        return StagingRing(size, directory=tempfile.gettempdir())


def print_table(cases: list[Case]) -> None:
    head = ("layout", "dir", "path", "MiB", "runs", "GB/s", "x page", "enq ms",
            "done ms", "sleep ms", "us/run", "blocked", "bytes")  # fmt: skip
    rows = []
    for c in cases:
        ratio = f"{c.ratio:.2f}" if c.ratio is not None else "-"
        blocked = "n/a" if c.host_blocked is None else str(c.host_blocked).lower()
        rows.append(
            [c.layout, c.direction, c.path, f"{c.bytes / MIB:.0f}", c.runs,
             f"{c.gbps:.2f}", ratio, f"{c.enqueue_ms:.2f}", f"{c.done_ms:.2f}",
             f"{c.sleep_ms:.1f}", f"{c.enqueue_us_per_run:.1f}", blocked,
             "ok" if c.bytes_ok else "BAD"]
        )  # fmt: skip
    print(table(head, rows, align="<<<>>>>>>>>>>"))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--blocks", type=int, default=None, help="blocks moved per pass (256)"
    )
    parser.add_argument("--num-blocks", type=int, default=1024, help="blocks per cache")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed passes per case (5)"
    )
    parser.add_argument("--sleep-ms", type=float, default=200.0)
    parser.add_argument("--ring-gib", type=float, default=1.0)
    parser.add_argument("--ring-dir", default="/dev/shm")


def run(args: argparse.Namespace) -> Report:
    """Every check; the report's exit code says how it went (see above)."""
    report = Report(args)
    if args.blocks is None:
        args.blocks = 64 if args.quick else 256
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): nothing to check")
        report.data = {"status": "no-cuda", "torch": torch.__version__}
        return report
    try:
        from npukv_store import native
        from npukv_store.device import get_backend, ordering
    except ImportError as exc:
        print(f"setup: cannot import npukv_store ({exc}); install its dependencies")
        report.data = {"status": "setup", "setup": str(exc)}
        report.exit_code = 2
        return report
    if not native.IS_NATIVE and "vllm._custom_ops" not in sys.modules:
        print("setup: the C extension is not in use; build it first:")
        print("    python setup.py build_ext --inplace")
        report.data = {"status": "setup", "setup": "the C extension is not in use"}
        report.exit_code = 2
        return report
    backend = get_backend(args.device)
    backend.bind_thread()
    ring = open_ring(int(args.ring_gib * (1 << 30)), args.ring_dir)
    region = backend.register_host(int(ring.data.ctypes.data), ring.size)
    region_registered = region.registered
    result: dict[str, Any] = {
        "status": "ok",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "native": native.IS_NATIVE,
        "ring": {"bytes": ring.size, "path": ring.path, "registered": region.registered,
                 "is_pinned": backend.is_host_registered(torch.from_numpy(ring.data))},
        "args": {k: v for k, v in vars(args).items() if k not in ("bench", "argv")},
    }  # fmt: skip
    print(
        f"device {result['device']}, torch {torch.__version__}, ring {result['ring']}"
    )
    cycles = sleep_cycles(torch, backend, args.sleep_ms)
    if cycles:
        result["pinning_probe"] = pinning_probe(torch, backend, ring, cycles)
        for name, row in result["pinning_probe"].items():
            print(f"{name:<24} {row}")
    cases: list[Case] = []
    try:
        for kind in ("tuple", "fused"):
            layers = make_caches(torch, kind, args, backend.device)
            rng = np.random.default_rng(len(cases))
            check = Check(torch, backend, ordering, ring, layers, args, rng)
            for direction in ("d2h", "h2d"):
                paths = ["per-page", "batch"]
                if args.device == "cuda":
                    paths.insert(1, "loop")
                row = [check.run(direction, p, args.sleep_ms, cycles) for p in paths]
                for case in row:
                    case.layout = kind
                    if case.path != "per-page":
                        case.ratio = case.gbps / row[0].gbps
                cases += row
            del check, layers
    finally:
        region.close()
        ring.close()
    if args.device == "cuda":  # what the last batch (the connector's path) used
        result["cuda_copy_api"] = native.cuda_copy_api()
    print_table(cases)
    # Which libcudart files the process maps once the copies ran: the C
    # extension's copies must share torch's runtime (one file), not a second one.
    with open("/proc/self/maps") as maps:
        result["libcudart_mapped"] = sorted(
            {line.split()[-1] for line in maps if "libcudart" in line}
        )
    print(f"libcudart mapped: {result['libcudart_mapped']}")
    if "cuda_copy_api" in result:
        print(f"copy_runs used: {result['cuda_copy_api']}")
    failed = [f"{c.layout} {c.direction} {c.path}" for c in cases if not c.bytes_ok]
    # Only the batch path is what the connector uses. The loop and per-page
    # copies are baselines: one queued operation per run, so past the ~1,000 a
    # stream holds they block the host behind a busy compute stream.
    failed += [
        f"{c.layout} {c.direction} {c.path} blocked"
        for c in cases
        if c.host_blocked and c.path == "batch"
    ]
    if args.device == "cuda" and not region_registered:
        failed.append("cudaHostRegister of the ring (see the warning above)")
    if failed:
        result["status"] = "failed"
        print(f"FAILED: {', '.join(failed)}")
    result["failed"] = failed
    result["cases"] = [asdict(c) for c in cases]
    report.data = result
    report.exit_code = 1 if failed else 0
    return report
