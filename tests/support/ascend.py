"""Stand-ins for vllm-ascend and an Ascend NPU, for the connector's tests.

- ``AscendMLAAttentionSpec`` and ``AscendSlidingWindowMLASpec`` mirror
  vllm-ascend 0.23.0.post1's class names and fields; :func:`ascend_mla` is
  the spec it builds for a plain MLA layer;
- ``FakeNpuBackend`` is the CPU backend (copies are memcpys) with the kind
  "npu", events that only complete when synchronized, and a compute stream
  that records what it was made to wait on;
- :func:`make_worker`: a registered worker, on such a backend when given.

Imports vLLM and torch: only the connector's tests use it (tests/connector).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

import npukv_store.device as device
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.device.cpu import CpuBackend
from tests.support.connector import BLOCK, settings

NOPE, ROPE = 16, 8  # kv_lora_rank, qk_rope_head_dim (512 and 64 in DeepSeek)
# vLLM 0.23's MLAAttentionSpec has compress_ratio; later ones do not
_PARENT_HAS_RATIO = "compress_ratio" in {f.name for f in fields(MLAAttentionSpec)}


@dataclass(frozen=True, kw_only=True)
class AscendMLAAttentionSpec(MLAAttentionSpec):
    """vllm-ascend 0.23.0.post1's fields and (non-sparse) page size."""

    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    sparse_head_dim: tuple[int, ...] | None = None
    cache_sparse_sfa_c8: bool = False
    cache_sparse_li_c8: bool = False
    c8_k_cache_dtype: torch.dtype = torch.int8
    c8_k_scale_cache_dtype: torch.dtype = torch.float16
    sfa_dcp_replicated_indexer_size: int = 1
    if not _PARENT_HAS_RATIO:
        compress_ratio: int = 1

    @property
    def page_size_bytes(self) -> int:
        # kv_cache_interface.py:66-121, branch by branch
        per_page = self.block_size * self.num_kv_heads
        replicas = self.sfa_dcp_replicated_indexer_size
        scale = self.c8_k_scale_cache_dtype.itemsize
        if self.cache_sparse_sfa_c8:  # (packed latent, indexer key[, scale])
            latent, _rope, index = self.sparse_head_dim or (0, 0, 0)
            key_dtype = self.c8_k_cache_dtype if self.cache_sparse_li_c8 else self.dtype
            return per_page * (
                latent * self.c8_k_cache_dtype.itemsize
                + index * replicas * key_dtype.itemsize
                + (replicas * scale if self.cache_sparse_li_c8 and index else 0)
            )
        if self.cache_sparse_li_c8:  # (nope, rope, int8 indexer key, its scale)
            nope, rope, index = self.sparse_head_dim or (0, 0, 0)
            return per_page * (
                (nope + rope) * self.dtype.itemsize
                + index * replicas * self.c8_k_cache_dtype.itemsize
                + replicas * scale
            )
        head = self.head_size
        if self.sparse_head_dim is not None and replicas > 1:
            nope, rope, index = self.sparse_head_dim
            head = nope + rope + index * replicas
        return per_page * (
            head * self.dtype.itemsize + self.scale_dim * self.scale_dtype.itemsize
        )


@dataclass(frozen=True, kw_only=True)
class AscendSlidingWindowMLASpec(SlidingWindowMLASpec):
    """kv_cache_interface.py:253 (DeepSeek V4)."""

    compress_ratio: int = 1


def ascend_mla(**kw) -> AscendMLAAttentionSpec:
    """The spec model_runner_v1.py:4993 builds for a plain MLA layer (and,
    with ``sparse_head_dim``, :4949-4985's for a sparse one)."""
    fields_ = {"head_size": NOPE + ROPE, "dtype": torch.bfloat16, **kw}
    return AscendMLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, **fields_)


def make_worker(tmp_path, config, caches, backend=None, **kw) -> WorkerSide:
    """A registered worker; on ``backend`` (a stand-in) when given."""
    original = device.get_backend
    if backend is not None:
        device.get_backend = lambda _device: backend
    try:
        worker = WorkerSide(*config, settings(tmp_path, **kw))
        worker.register(caches)
    finally:
        device.get_backend = original
    assert worker.disabled_reason == "", worker.disabled_reason
    return worker


class FakeEvent:
    """Complete only once synchronized: a copy on a device stream that no one
    fenced may still be running."""

    def __init__(self) -> None:
        self.recorded = False
        self.synchronized = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[FakeEvent] = []
        self.on_wait = None  # called with each event waited on

    def wait_event(self, event) -> None:
        self.waited.append(event)
        if self.on_wait is not None:
            self.on_wait(event)

    def wait_stream(self, other) -> None:
        pass

    def raw_handle(self) -> int:
        return 0


class FakeNpuBackend(CpuBackend):
    kind = "npu"  # type: ignore[assignment]
    host_view = None  # device memory: loads go through host slots

    def __init__(self) -> None:
        super().__init__()
        self.compute = FakeStream()
        self.events: list[FakeEvent] = []

    def current_stream(self):
        return self.compute

    def new_stream(self):
        return FakeStream()

    def new_event(self, timing: bool = False):
        event = FakeEvent()
        self.events.append(event)
        return event
