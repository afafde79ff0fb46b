"""The ordering protocol of docs/device.md §1.3 as three calls, on every device.

Runs in: ``record_written`` in the forward thread; the others in a transfer
thread that has called ``backend.bind_thread()``.

    record_written(backend)               -> Event  (at save_kv_layer, or in
        wait_for_save in bulk mode): marks the KV write on the compute stream
    d2h_after(backend, written, xfer, src, dst, sizes) -> Event  (save): xfer
        waits for ``written`` (device side), then the D2H copies; the ring slot
        may be read once the returned event completes
    h2d_after(backend, compute, xfer, src, dst, sizes) -> Event  (load): xfer
        waits for the compute stream's pending work (zeroing of the destination
        blocks), then the H2D copies; before the layer's attention the caller
        makes compute wait: ``compute.wait_event(done)`` (no host sync)

The source (save) and destination (load) blocks must stay allocated until the
returned event completes and completion has been reported to the scheduler.
Kept as functions over the backend API, not backend methods, so every device
gets the same order and the tests can check it against a recording fake.
"""

from __future__ import annotations

import numpy as np

from npukv_store.device.base import DeviceBackend, Event, Stream


def record_written(backend: DeviceBackend) -> Event:
    """An event recorded now on the calling thread's current (compute) stream."""
    written = backend.new_event()
    written.record(backend.current_stream())
    return written


def d2h_after(
    backend: DeviceBackend,
    written: Event,
    xfer: Stream,
    src_ptrs: np.ndarray,
    dst_ptrs: np.ndarray,
    sizes: np.ndarray,
) -> Event:
    """Save: device -> host on ``xfer`` once ``written`` has completed; returns
    the event that completes with the copies."""
    xfer.wait_event(written)
    backend.copy_runs(src_ptrs, dst_ptrs, sizes, "d2h", xfer)
    done = backend.new_event()
    done.record(xfer)
    return done


def h2d_after(
    backend: DeviceBackend,
    compute: Stream,
    xfer: Stream,
    src_ptrs: np.ndarray,
    dst_ptrs: np.ndarray,
    sizes: np.ndarray,
) -> Event:
    """Load: host -> device on ``xfer`` after the work enqueued on ``compute`` so
    far; returns the event that completes with the copies."""
    xfer.wait_stream(compute)
    backend.copy_runs(src_ptrs, dst_ptrs, sizes, "h2d", xfer)
    done = backend.new_event()
    done.record(xfer)
    return done
