"""describe_layer / build_runs on CPU tensors built exactly like the real caches:
the six vLLM layouts as views of one shared int8 buffer, the legacy [2, B, ...]
tensor, Ascend (k, v) tuples in 2 MiB-aligned over-allocated buffers, MLA
(nope, rope), state lists, and compressed MLA's overlapping ``full`` view.

Every case gathers random blocks into a numpy ring with ctypes.memmove through
the runs build_runs returns, compares each row with the block read through the
logical tensor, scatters the rows back into the zeroed cache and checks that
exactly those blocks came back and no other byte was written.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npukv_store.connector.worker.block_runs import build_runs
from npukv_store.connector.worker.pages import (
    LayerLayout,
    LayoutError,
    Segment,
    describe_layer,
)
from npukv_store.errors import ConfigError

MiB = 1 << 20
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# Expected page of one block, as an order of the logical [H, N, C] dims. A
# block-compact layout is one run in physical order (LBNHC: [N, H, C]); LHBNC and
# BHLNC split a block per head, one run per head in head order: [H, N, C].
PAGE_ORDER = {
    "LBHNC": "HNC",
    "LBNHC": "NHC",
    "LHBNC": "HNC",
    "BLHNC": "HNC",
    "BLNHC": "NHC",
    "BHLNC": "HNC",
}
PER_HEAD = {"LHBNC", "BHLNC"}
# Expected bytes are read through integer views: a float copy could quiet a NaN.
INT_OF = {
    torch.int8: torch.int8,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
}


@dataclass
class Case:
    """A cache: the buffers owning its bytes, the value vLLM hands over per layer,
    and the expected page as integer views (block dim 0), concatenated in order."""

    buffers: list
    values: list
    parts: list


def random_bytes(nbytes: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)


def vllm_views(buffer, layout: str, dims: dict[str, int], dtype) -> list:
    """Per-layer logical [B, H, N, C] views of one buffer with ``layout`` as the
    physical order, as allocate_kv_cache + create_kv_cache_views build them."""
    strides, step = {}, 1
    for dim in reversed(layout):
        strides[dim] = step
        step *= dims[dim]
    typed = buffer.view(dtype)
    assert typed.numel() == step
    return [
        torch.as_strided(
            typed,
            tuple(dims[d] for d in "BHNC"),
            tuple(strides[d] for d in "BHNC"),
            layer * strides["L"],
        )
        for layer in range(dims["L"])
    ]


def vllm_case(layout, dtype=torch.float16, seed=0, **dims) -> Case:
    elem = torch.empty(0, dtype=dtype).element_size()
    buffer = random_bytes(int(np.prod(list(dims.values()))) * elem, seed)
    views = vllm_views(buffer, layout, dims, dtype)
    order = [1 + "HNC".index(d) for d in PAGE_ORDER[layout]]
    parts = [v.view(INT_OF[dtype]).permute(0, *order) for v in views]
    return Case([buffer], views, parts)


def aligned(nbytes: int, seed: int):
    """vllm-ascend's _align_memory: over-allocate by 2 MiB, slice to alignment."""
    raw = random_bytes(nbytes + 2 * MiB, seed)
    start = -raw.data_ptr() % (2 * MiB)
    return raw, raw[start : start + nbytes]


def ascend_tuple_case(num_blocks, block_size, heads, dims, dtype, seed=0) -> Case:
    """One tuple per layer: each member [B, N, H, D] in its own aligned buffer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    raws, members = [], []
    for i, dim in enumerate(dims):
        raw, data = aligned(num_blocks * block_size * heads * dim * elem, seed + i)
        raws.append(raw)
        members.append(data.view(dtype).view(num_blocks, block_size, heads, dim))
    return Case(raws, [tuple(members)], [m.view(INT_OF[dtype]) for m in members])


def gather(layouts, blocks, slots, num_slots, pad=0):
    row_bytes = sum(layout.page_bytes for layout in layouts) + pad
    ring = np.zeros((num_slots, row_bytes), dtype=np.uint8)
    src, dst, sizes = build_runs(layouts, blocks, slots, ring.ctypes.data, row_bytes)
    assert src.dtype == dst.dtype == sizes.dtype == np.int64
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    return ring


def scatter(layouts, ring, blocks, slots):
    src, dst, sizes = build_runs(
        layouts, blocks, slots, ring.ctypes.data, ring.shape[1]
    )
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(s, d, n)


def expected_page(case: Case, block: int) -> bytes:
    return b"".join(
        p[block].contiguous().view(torch.uint8).numpy().tobytes() for p in case.parts
    )


def pages_match(case, ring, blocks, slots) -> bool:
    for block, slot in zip(blocks, slots, strict=True):
        page = expected_page(case, block)
        if ring[slot, : len(page)].tobytes() != page or ring[slot, len(page) :].any():
            return False
    return True


def verify_round_trip(case, blocks, slots, num_slots=None, pad=0, num_blocks=None):
    """Gather, compare pages, scatter into the zeroed cache, compare again."""
    num_blocks = num_blocks or case.parts[0].shape[0]
    layouts = [
        describe_layer(f"model.layers.{i}.attn", v, num_blocks)
        for i, v in enumerate(case.values)
    ]
    ring = gather(layouts, blocks, slots, num_slots or len(blocks), pad)
    assert pages_match(case, ring, blocks, slots)
    saved = [p[blocks].clone() for p in case.parts]
    assert any(s.any() for s in saved)  # random bytes, not an all-zero cache
    for buffer in case.buffers:
        buffer.zero_()
    scatter(layouts, ring, blocks, slots)
    for p, s in zip(case.parts, saved, strict=True):
        assert torch.equal(p[blocks], s)
        p[blocks] = 0
    for buffer in case.buffers:  # nothing but those blocks was written
        assert buffer.count_nonzero() == 0
    return layouts


# --- vLLM standardised layouts: [B, H, N, C] views of one shared buffer -----------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_layout_segments_and_round_trip(layout):
    dims = dict(L=3, B=8, H=4, N=16, C=32)
    case = vllm_case(layout, **dims)
    page_bytes = 4 * 16 * 32 * 2
    for view in case.values:
        got = describe_layer("model.layers.0.attn", view, 8)
        assert got.page_bytes == page_bytes
        assert got.kind.startswith("tensor[B,4,16,32]")
        if layout in PER_HEAD:
            assert [s.run_bytes for s in got.segments] == [16 * 32 * 2] * 4
            heads = [s.base_ptr - view.data_ptr() for s in got.segments]
            assert heads == [h * view.stride(1) * 2 for h in range(4)]
        else:
            assert [s.run_bytes for s in got.segments] == [page_bytes]
            assert got.segments[0].base_ptr == view.data_ptr()
        assert {s.block_stride for s in got.segments} == {view.stride(0) * 2}
        assert {s.num_blocks for s in got.segments} == {8}
    verify_round_trip(case, [5, 0, 7, 3], [2, 0, 3, 1], num_slots=5, pad=64)


def test_cpu_attn_measured_shape():
    """docs/vllm.md §1: CPU_ATTN, 2 heads, head 64, f32, block 32: shape
    [B, 2, 32, 128], stride (8192, 4096, 128, 1), block_stride 32768 B, one
    page per block."""
    case = vllm_case("LBHNC", torch.float32, L=2, B=16, H=2, N=32, C=128)
    assert case.values[1].stride() == (8192, 4096, 128, 1)
    got = describe_layer("model.layers.1.self_attn.attn", case.values[1], 16)
    assert got.segments == (Segment(case.values[1].data_ptr(), 32768, 32768, 16),)
    verify_round_trip(case, [15, 1, 2], [0, 2, 1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(list(INT_OF)),
    shape=st.tuples(*(st.integers(1, n) for n in (3, 6, 3, 4, 6))),
    pad=st.integers(0, 9),
    data=st.data(),
)
def test_vllm_layouts_random_blocks(layout, dtype, shape, pad, data):
    dims = dict(zip("LBHNC", shape, strict=True))
    case = vllm_case(layout, dtype, seed=data.draw(st.integers(0, 99)), **dims)
    blocks = data.draw(
        st.lists(st.integers(0, dims["B"] - 1), min_size=1, max_size=6, unique=True)
    )
    num_slots = len(blocks) + data.draw(st.integers(0, 3))
    slots = data.draw(st.permutations(range(num_slots)))[: len(blocks)]
    verify_round_trip(case, blocks, slots, num_slots, pad)


def test_checker_catches_a_wrong_stride():
    """The harness is not vacuous: a block stride one element off breaks the pages."""
    case = vllm_case("LBNHC", L=2, B=6, H=2, N=4, C=8)
    good = describe_layer("l0", case.values[0], 6)
    seg = good.segments[0]
    bad = Segment(seg.base_ptr, seg.block_stride + 2, seg.run_bytes, seg.num_blocks)
    bad_layout = LayerLayout("l0", (bad,), good.page_bytes)
    case.parts = case.parts[:1]
    assert pages_match(case, gather([good], [3, 1], [0, 1], 2), [3, 1], [0, 1])
    assert not pages_match(
        case, gather([bad_layout], [3, 1], [0, 1], 2), [3, 1], [0, 1]
    )


# --- legacy tensor and Ascend containers --------------------------------------------


def test_legacy_kv_planes_are_two_segments():
    """Pre-standardisation [2, B, H, N, D]: one block = K page, then V page."""
    buffer = random_bytes(2 * 7 * 2 * 16 * 8 * 2)
    kv = buffer.view(torch.float16).view(2, 7, 2, 16, 8)
    got = describe_layer("layers.0", kv, 7)
    page = 2 * 16 * 8 * 2
    assert got.kind.startswith("legacy[2,B,2,16,8]")
    assert [(s.base_ptr - kv.data_ptr(), s.run_bytes) for s in got.segments] == [
        (0, page),
        (7 * page, page),
    ]
    ints = kv.view(torch.int16)
    verify_round_trip(Case([buffer], [kv], [ints[0], ints[1]]), [6, 2], [1, 0])


def test_ascend_kv_tuple_in_aligned_buffers():
    """(k, v) each [B, N, H, D] (V with its own head size) in its own raw buffer,
    over-allocated by 2 MiB and sliced to 2 MiB alignment: sized by shape only."""
    case = ascend_tuple_case(10, 16, 2, (8, 4), torch.bfloat16)
    k, v = case.values[0]
    assert [t.data_ptr() % (2 * MiB) for t in (k, v)] == [0, 0]
    assert k.untyped_storage().nbytes() > 10 * 16 * 2 * 8 * 2
    got = describe_layer("model.layers.0.self_attn.attn", (k, v), 10)
    assert got.page_bytes == 16 * 2 * (8 + 4) * 2
    assert [s.base_ptr for s in got.segments] == [k.data_ptr(), v.data_ptr()]
    assert got.kind == "tuple(tensor[B,16,2,8], tensor[B,16,2,4])"
    verify_round_trip(case, [9, 0, 4], [1, 2, 0])


def test_ascend_mla_nope_rope_and_one_tuple():
    case = ascend_tuple_case(6, 16, 1, (32, 8), torch.float16, seed=3)
    got = describe_layer("model.layers.0.self_attn.mla_attn", case.values[0], 6)
    assert [s.run_bytes for s in got.segments] == [16 * 32 * 2, 16 * 8 * 2]
    verify_round_trip(case, [1, 5], [0, 1])
    single = ascend_tuple_case(6, 16, 1, (24,), torch.int8, seed=5)
    verify_round_trip(single, [2], [0])


def test_mamba_state_list_in_one_buffer():
    """Linear-attention states: consecutive regions of one raw buffer."""
    conv_bytes, ssm_bytes = 9 * 3 * 8 * 2, 9 * 2 * 4 * 4 * 4
    buffer = random_bytes(conv_bytes + ssm_bytes, seed=7)
    conv = buffer[:conv_bytes].view(torch.float16).view(9, 3, 8)
    ssm = buffer[conv_bytes:].view(torch.float32).view(9, 2, 4, 4)
    states = [conv, ssm.transpose(2, 3)]  # a transposed view tiles all the same
    got = describe_layer("model.layers.3.linear_attn", states, 9)
    assert [s.run_bytes for s in got.segments] == [3 * 8 * 2, 2 * 4 * 4 * 4]
    parts = [conv.view(torch.int16), ssm.view(torch.int32)]
    verify_round_trip(Case([buffer], [states], parts), [8, 0, 4], [0, 1, 2])


def compressed_mla(num_blocks=8, block_size=4, extra_blocks=0):
    """[k, scale, full]: per block page = k (f16 [N, 8]) then scale (f32 [N, 1]);
    ``full`` is an int8 [B, page] view over both (vllm-ascend overlap_full_kv_cache)."""
    k_bytes, scale_bytes = block_size * 8 * 2, block_size * 4
    page = k_bytes + scale_bytes
    buffer = random_bytes((num_blocks + extra_blocks) * page, seed=11)
    k = torch.as_strided(
        buffer.view(torch.float16), (num_blocks, block_size, 8), (page // 2, 8, 1)
    )
    scale = torch.as_strided(
        buffer.view(torch.float32),
        (num_blocks, block_size, 1),
        (page // 4, 1, 1),
        k_bytes // 4,
    )
    full = buffer[: num_blocks * page].view(num_blocks, page)
    return buffer, k, scale, full, page


def test_compressed_mla_list_drops_the_overlapping_full_view(caplog):
    buffer, k, scale, full, page = compressed_mla()
    with caplog.at_level(logging.DEBUG, logger="npukv_store.connector.worker.pages"):
        got = describe_layer("model.layers.0.attn", [k, scale, full], 8)
    assert [s.base_ptr for s in got.segments] == [k.data_ptr(), scale.data_ptr()]
    assert got.page_bytes == page
    assert f"dropped tensor[B,{page}]" in got.kind
    assert "member 2" in caplog.text
    # k and scale are adjacent in the block and in the row: one run per block
    src, dst, sizes = build_runs([got], [1, 5, 3], [0, 1, 2], 0, page)
    assert sizes.tolist() == [page] * 3
    parts = [k.view(torch.int16), scale.view(torch.int32)]
    verify_round_trip(Case([buffer], [[k, scale, full]], parts), [7, 2, 3], [2, 0, 1])


def test_partly_overlapping_members_are_refused():
    buffer, k, scale, full, page = compressed_mla(extra_blocks=1)
    half = full[:, 48:72]  # the end of k and the start of scale
    assert describe_layer("l", [k, scale, half], 8).page_bytes == page  # inside both
    with pytest.raises(LayoutError, match=r"'l'.*members \[0\] and \[1\]"):
        describe_layer("l", [k, half], 8)
    next_block = torch.as_strided(k, k.shape, k.stride(), page // 2)
    with pytest.raises(LayoutError, match="sharing bytes"):
        describe_layer("l", (k, next_block), 8)  # meets k one block later


def test_segments_follow_addresses_not_logical_order():
    """Two outer dims, logical [B, H, X, N, C] but physical [X, H, B, N, C]: the
    page holds the block's runs in address order, i.e. [X, H, N, C]."""
    buffer = random_bytes(2 * 3 * 5 * 4 * 8 * 2, seed=13)
    t = torch.as_strided(
        buffer.view(torch.float16), (5, 3, 2, 4, 8), (32, 160, 480, 8, 1)
    )
    got = describe_layer("l", t, 5)
    assert [s.base_ptr - t.data_ptr() for s in got.segments] == [
        960 * x + 320 * h for x in range(2) for h in range(3)
    ]
    parts = [t.view(torch.int16).permute(0, 2, 1, 3, 4)]
    verify_round_trip(Case([buffer], [t], parts), [4, 1], [1, 0])


def test_member_inside_a_kept_member_is_dropped():
    """[head 0 view, both heads]: the whole view is kept (it is not inside the
    head-0 view), then the head-0 view lies inside it and is dropped."""
    buffer = random_bytes(2 * 6 * 4 * 8 * 2, seed=17)
    both = torch.as_strided(buffer.view(torch.float16), (6, 2, 4, 8), (32, 192, 8, 1))
    got = describe_layer("l", [both[:, 0], both], 6)
    assert got.kind == "list(dropped tensor[B,4,8], tensor[B,2,4,8] x2 runs)"
    parts = [both.view(torch.int16)]
    verify_round_trip(Case([buffer], [[both[:, 0], both]], parts), [5, 0], [0, 1])


def test_empty_containers_are_ignored():
    assert describe_layer("", [], 16) is None
    assert describe_layer("model.layers.2.linear_attn", (), 16) is None


# --- refusals --------------------------------------------------------------------


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param(lambda t: t[..., ::2], id="every-other-element"),
        pytest.param(lambda t: t[..., :16], id="k-half-of-fused"),
        pytest.param(lambda t: t[..., 16:], id="v-half-of-fused"),
        pytest.param(lambda t: t[:, :, ::2], id="every-other-token"),
    ],
)
def test_slices_of_the_block_payload_are_refused(cut):
    case = vllm_case("LBHNC", L=2, B=8, H=4, N=16, C=32)
    with pytest.raises(LayoutError, match=r"'model.layers.1.attn'.*expected the last"):
        describe_layer("model.layers.1.attn", cut(case.values[1]), 8)


def test_overlapping_elements_are_refused():
    shared = torch.zeros(1, 16, 8, dtype=torch.float16).expand(4, 16, 8)
    with pytest.raises(LayoutError, match="do not overlap"):
        describe_layer("l", shared, 4)


def test_too_few_blocks_are_refused():
    k, v = ascend_tuple_case(8, 16, 1, (8, 8), torch.float16).values[0]
    with pytest.raises(LayoutError, match=r"'l'\[1\]: found shape \[6,.*at least 7"):
        describe_layer("l", (k, v[:6]), 7)
    with pytest.raises(LayoutError, match="at least 9 blocks"):
        describe_layer("l", vllm_case("LBNHC", L=1, B=8, H=2, N=4, C=8).values[0], 9)


def test_not_a_tensor_is_refused():
    with pytest.raises(LayoutError, match="found int, expected a tensor"):
        describe_layer("l", 3, 4)
    with pytest.raises(LayoutError, match=r"'l'\[0\]: found ndarray"):
        describe_layer("l", [np.zeros((4, 8))], 4)


def test_npu_private_format_is_refused():
    case = ascend_tuple_case(4, 16, 1, (8, 8), torch.float16)
    seen = []

    def nz(t):
        seen.append(t.data_ptr())
        return 29

    with pytest.raises(LayoutError, match=r"format 29 \(FRACTAL_NZ\).*ND") as err:
        describe_layer("l", case.values[0], 4, npu_format=nz)
    assert isinstance(err.value, ConfigError)
    assert seen == [case.values[0][0].data_ptr()]
    got = describe_layer("l", case.values[0], 4, npu_format=lambda t: 2)
    assert len(got.segments) == 2


# --- build_runs ---------------------------------------------------------------------


def test_build_runs_merges_consecutive_blocks_and_rows():
    case = vllm_case("LBHNC", L=1, B=8, H=2, N=4, C=8)
    layout = describe_layer("l", case.values[0], 8)
    src, dst, sizes = build_runs([layout], [2, 3, 4, 6], [0, 1, 2, 3], 1000, 128)
    assert sizes.tolist() == [3 * 128, 128]
    assert dst.tolist() == [1000, 1000 + 3 * 128]
    assert src.tolist() == [layout.segments[0].base_ptr + b * 128 for b in (2, 6)]
    verify_round_trip(case, [2, 3, 4, 6], [0, 1, 2, 3])


def test_build_runs_per_head_rows_and_layer_offsets():
    """Two per-head layers: row = layer 0 heads then layer 1 heads; no merging
    across heads, whose runs are one block apart in the cache."""
    case = vllm_case("LHBNC", L=2, B=5, H=3, N=2, C=4)
    layouts = [describe_layer(f"l{i}", v, 5) for i, v in enumerate(case.values)]
    src, dst, sizes = build_runs(layouts, [4], [1], 0, 2 * 48 + 16)
    assert sizes.tolist() == [16] * 6
    assert dst.tolist() == [112 + 16 * i for i in range(6)]
    assert src.tolist() == [
        s.base_ptr + 4 * 16 for lay in layouts for s in lay.segments
    ]


def test_build_runs_rejects_bad_input():
    case = vllm_case("LBHNC", L=1, B=8, H=2, N=4, C=8)
    layout = describe_layer("l", case.values[0], 8)
    with pytest.raises(ValueError, match="block id 8"):
        build_runs([layout], [1, 8], [0, 1], 0, 128)
    with pytest.raises(ValueError, match="block id -1"):
        build_runs([layout], [-1], [0], 0, 128)
    with pytest.raises(ValueError, match="found 1, expected one per block id"):
        build_runs([layout], [1, 2], [0], 0, 128)
    with pytest.raises(ValueError, match="ring_row_bytes: found 100"):
        build_runs([layout], [1], [0], 0, 100)
    with pytest.raises(ValueError, match="found slot -2"):
        build_runs([layout], [1], [-2], 0, 128)
    empty = build_runs([layout], [], [], 0, 128)
    assert [a.size for a in empty] == [0, 0, 0]
