"""vllm-ascend 0.30.0rc2's KV cache registrations, rebuilt on CPU tensors.

What ``register_kv_caches`` receives from vllm-ascend 0.30.0rc2 (pinned to
vLLM 0.30.0), built the way its model runners build it: raw int8 buffers
over-allocated by 2 MiB and sliced to 2 MiB alignment, then typed views
made with ``torch.as_strided`` whose block stride is the (possibly padded)
physical page, not the shape. The code is ours; each builder cites the
sdist lines (``vllm_ascend/...``) whose view it mirrors.

- :func:`combined_kv`: GQA ``(k, v)`` as two views of one allocation with K
  and V interleaved per (kernel) block, MRV1's unpadded form and MRV2's
  padded one (kernel blocks included);
- :func:`page_strided`: ``_adjust_kv_layout``: several tensors of different
  dtypes packed in one page per block, at a page stride (Mamba states over
  padded hybrid pages, page-strided MLA (nope, rope), an indexer key and
  its scale with an overlapping ``full`` view);
- :func:`mxfp_views`: C8-MXFP's four views (FP8 K and V, E8M0 K and V
  scales) of one packet per kernel block, in PA_NZ order;
- :func:`separate`: typed ``raw.view(dtype).view(shape)`` members of their
  own buffers (per-layer KV dtypes, the SFA indexer's int8 key and fp16
  scale, TurboQuant's packed INT4 latent slot).

A :class:`Registration` keeps the buffers that own the bytes, so a test can
zero them, load, and check that no byte outside the loaded blocks changed.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npukv_store.connector.worker.block_runs import build_runs

MiB = 1 << 20
# attention_c8_mxfp.py:66-75 (PA_NZ fragments; one E8M0 byte per 32 values)
MXFP_DIM_FRAG = 32
MXFP_K_SCALE_TOKEN_FRAG = 16
MXFP_V_SCALE_DIM_FRAG = 16
MXFP_SCALE_GROUP = 64
MXFP_SCALE_PAIR = 2
MXFP_GROUP = 32


@dataclass
class Registration:
    """One layer's value as vLLM hands it over, the buffers that own its
    bytes, and which members hold data (an overlapping ``full`` view does
    not: its bytes are the others')."""

    value: Any
    buffers: list[torch.Tensor] = field(default_factory=list)
    data_members: tuple[int, ...] | None = None  # None: all

    def members(self) -> list[torch.Tensor]:
        if isinstance(self.value, tuple | list):
            keep = self.data_members or range(len(self.value))
            return [self.value[i] for i in keep]
        return [self.value]

    def block_bytes(self, block: int, rows: int = 1) -> bytes:
        """What the connector must store for vLLM block ``block``: for each
        data member in order, its ``rows`` kernel rows, each in address order
        (dims sorted by stride), read through torch's own indexing."""
        out = []
        for t in self.members():
            for row in range(block * rows, (block + 1) * rows):
                out.append(address_order(t[row]).view(torch.uint8).numpy().tobytes())
        return b"".join(out)

    def zero_blocks(self, blocks: list[int], rows: int = 1) -> None:
        for t in self.members():
            for block in blocks:
                t[block * rows : (block + 1) * rows].view(torch.uint8).zero_()


def address_order(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` with its dims in physical (stride) order:
    the bytes as they lie in memory, gaps removed."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(*order).contiguous()


def aligned_int8(nbytes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_allocate_int8_cache_tensor`` with a KV transfer config
    (model_runner_v1.py:4868-4890, ``_align_memory`` :4701-4705;
    v2/attn_utils.py:795-818): an int8 buffer 2 MiB larger than asked,
    sliced to a 2 MiB-aligned start. Filled with random bytes (vLLM zeroes
    it; a test needs something to compare). Returns (owner, slice)."""
    gen = torch.Generator().manual_seed(seed)
    owner = torch.randint(
        -128, 128, (nbytes + 2 * MiB,), dtype=torch.int8, generator=gen
    )
    start = -owner.data_ptr() % (2 * MiB)
    return owner, owner[start : start + nbytes]


def combined_kv(
    raw: torch.Tensor,
    num_blocks: int,
    kernel_block: int,
    heads: int,
    head: int,
    dtype: torch.dtype,
    *,
    page_stride_bytes: int | None = None,
    rows_per_block: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA (k, v) over one allocation, K and V interleaved per kernel block.

    ``page_stride_bytes=None``: MRV1's combined path
    (model_runner_v1.py:5720-5744): shape (2, rows, kb, H, D) with strides
    (hidden, 2 * hidden, ...): kernel row r's K at 2*hidden*r, its V right
    after. Else MRV2's ``_reshape_combined_attention_kv_cache``
    (v2/attn_utils.py:687-722): the kernel row stride is the padded page
    over ``rows_per_block`` (kernel rows per vLLM block), the tail of each
    padded kernel page being padding (hybrid pages, page_size_padded).
    """
    hidden = kernel_block * heads * head
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = num_blocks * rows_per_block
    if page_stride_bytes is None:
        row_stride = 2 * hidden
    else:
        assert page_stride_bytes % (rows_per_block * elem) == 0
        row_stride = page_stride_bytes // rows_per_block // elem
        assert row_stride >= 2 * hidden
    typed = raw.view(dtype)
    assert typed.numel() >= (rows - 1) * row_stride + 2 * hidden
    both = torch.as_strided(
        typed,
        (2, rows, kernel_block, heads, head),
        (hidden, row_stride, heads * head, head, 1),
        typed.storage_offset(),
    )
    return both[0], both[1]


def page_strided(
    raw: torch.Tensor,
    shapes: list[tuple[int, ...]],
    dtypes: list[torch.dtype],
    page_bytes: int,
    *,
    overlap_full: bool = False,
    initial_offset: int = 0,
) -> list[torch.Tensor]:
    """``_adjust_kv_layout`` (model_runner_v1.py:5333-5365; MRV2's
    ``_adjust_dsv4_kv_layout``, v2/attn_utils.py:656-684): member i is a
    dense [B, ...] view of dtype i whose dim 0 strides by ``page_bytes``,
    placed right after member i-1 inside the page; with ``overlap_full``
    member 2 restarts at the page's start (a view over members 0 and 1)."""
    assert raw.element_size() == 1
    base = raw.storage_offset() + initial_offset
    offset = base
    views = []
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        if overlap_full and index == 2:
            offset = base
        elem = torch.empty(0, dtype=dtype).element_size()
        assert offset % elem == 0
        assert page_bytes % elem == 0
        dense = torch.empty(shape, device="meta").stride()
        views.append(
            torch.as_strided(
                raw.view(dtype), shape, (page_bytes // elem, *dense[1:]), offset // elem
            )
        )
        offset += dense[0] * elem
    return views


def mxfp_sections(heads: int, block: int, k_dim: int, v_dim: int) -> tuple[int, ...]:
    """attention_c8_mxfp.py:164-175: bytes of K, K scale, V, V scale in one
    kernel block's packet (FP8 values, one E8M0 byte per 32 values)."""
    return (
        heads * block * k_dim,
        heads * block * k_dim // MXFP_GROUP,
        heads * block * v_dim,
        heads * block * v_dim // MXFP_GROUP,
    )


def mxfp_views(
    raw: torch.Tensor,
    num_kernel_blocks: int,
    heads: int,
    k_dim: int,
    v_dim: int,
    block: int,
    *,
    pitch: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``mxfp_paged_cache_views`` (attention_c8_mxfp.py:195-233): one packet
    [K | K scale | V | V scale | padding] per kernel block at ``pitch``
    bytes; the value is (K, V, K scale, V scale), K/V as FP8 [Bn, H, D/32,
    bs, 32], scales as uint8 E8M0 6-D views: tuple order is not address
    order (K scale lies between K and V)."""
    k_b, ks_b, v_b, vs_b = mxfp_sections(heads, block, k_dim, v_dim)
    payload = k_b + ks_b + v_b + vs_b
    pitch = payload if pitch is None else pitch
    assert pitch >= payload
    assert raw.numel() >= num_kernel_blocks * pitch
    n = num_kernel_blocks
    shapes = (
        (n, heads, k_dim // MXFP_DIM_FRAG, block, MXFP_DIM_FRAG),
        (n, heads, v_dim // MXFP_DIM_FRAG, block, MXFP_DIM_FRAG),
        (n, heads, block // MXFP_K_SCALE_TOKEN_FRAG, k_dim // MXFP_SCALE_GROUP,
         MXFP_K_SCALE_TOKEN_FRAG, MXFP_SCALE_PAIR),
        (n, heads, v_dim // MXFP_V_SCALE_DIM_FRAG, block // MXFP_SCALE_GROUP,
         MXFP_V_SCALE_DIM_FRAG, MXFP_SCALE_PAIR),
    )  # fmt: skip
    offsets = (0, k_b + ks_b, k_b, k_b + ks_b + v_b)
    dtypes = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.uint8, torch.uint8)
    views = []
    for shape, offset, dtype in zip(shapes, offsets, dtypes, strict=True):
        strides = (pitch, *(math.prod(shape[i + 1 :]) for i in range(1, len(shape))))
        views.append(
            torch.as_strided(
                raw.view(dtype), shape, strides, raw.storage_offset() + offset
            )
        )
    return tuple(views)


def separate(
    members: list[tuple[tuple[int, ...], torch.dtype]], seed: int
) -> Registration:
    """Members in buffers of their own, ``raw.view(dtype).view(shape)``
    (model_runner_v1.py:5850-5866, the SFA indexer's :5551-5593, MRV2's
    v2/attn_utils.py:1636-1644): per-layer or per-member KV dtypes (C8's
    int8 K beside a bf16 V or rope, an fp16 or E8M0 scale), packed slots."""
    owners, views = [], []
    for i, (shape, dtype) in enumerate(members):
        elem = torch.empty(0, dtype=dtype).element_size()
        owner, raw = aligned_int8(math.prod(shape) * elem, seed + i)
        owners.append(owner)
        views.append(raw.view(dtype).view(shape))
    return Registration(tuple(views), owners)


def tq4_slot_bytes(kv_lora_rank: int, rope: int) -> int:
    """attention/utils.py:104-115: one TurboQuant 4-bit latent slot per
    token: the nope half packed two INT4 values per byte, the bf16 rope and
    one fp16 scale. The spec's head_size is this, in int8
    (model_runner_v1.py:6201-6206)."""
    return kv_lora_rank // 2 + rope * 2 + 2


def c8_packed_head_bytes(kv_lora_rank: int, rope: int, tile: int) -> int:
    """attention/utils.py:90-101: SFA C8's packed slot: int8 nope, bf16 rope,
    one fp32 scale per tile of the nope."""
    return kv_lora_rank + rope * 2 + (kv_lora_rank // tile) * 4


# -- byte-exact checks through the run arithmetic ----------------------------------


def ring_round_trip(
    regs: dict[str, Registration],
    layouts: dict[str, Any],
    blocks: list[int],
    targets: list[int],
    rows: int = 1,
) -> None:
    """Through the worker's run arithmetic (build_runs), without a store:
    gather ``blocks`` of every layer into ring rows, compare each row with
    the bytes read through torch, zero every buffer, scatter the rows into
    ``targets``, compare again, and check that zeroing those blocks leaves
    every buffer zero (no byte outside them, padding included, was written)."""
    order = list(regs)
    row_bytes = sum(layouts[n].page_bytes for n in order)
    ring = np.zeros((len(blocks), row_bytes), np.uint8)
    slots = list(range(len(blocks)))
    plans = [layouts[n] for n in order]
    src, dst, sizes = build_runs(plans, blocks, slots, ring.ctypes.data, row_bytes)
    _memmove(src, dst, sizes)
    for slot, block in enumerate(blocks):
        expected = b"".join(regs[n].block_bytes(block, rows) for n in order)
        assert ring[slot].tobytes() == expected, (slot, block)
    saved = {n: [regs[n].block_bytes(b, rows) for b in blocks] for n in order}
    for reg in regs.values():
        for buffer in reg.buffers:
            buffer.zero_()
    src, dst, sizes = build_runs(plans, targets, slots, ring.ctypes.data, row_bytes)
    _memmove(dst, src, sizes)
    for n in order:
        assert [regs[n].block_bytes(b, rows) for b in targets] == saved[n], n
        regs[n].zero_blocks(targets, rows)
    for n in order:
        assert all(int(b.count_nonzero()) == 0 for b in regs[n].buffers), n


def _memmove(src: Any, dst: Any, sizes: Any) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)
