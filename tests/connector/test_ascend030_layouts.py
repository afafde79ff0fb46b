"""vllm-ascend 0.30.0rc2's KV layouts: stored and loaded byte-exact, addresses
from strides, and a namespace that changes with the KV format (issue 38
part 2; docs/device.md §7).

The registrations are built as vllm-ascend 0.30.0rc2 builds them
(tests/support/ascend030.py cites its lines): K and V interleaved per block
in one allocation, padded page strides, kernel rows, one backing tensor for
a hybrid's attention and Mamba layers, C8-MXFP's packets, per-layer KV
dtypes, C8 and INT4 (TurboQuant) packed latents with their scales, and
Model Runner V2's dict. Each case either goes through a real worker (save
into a store, load into other blocks of zeroed tensors on a fake NPU) or,
where the engine is not one the connector serves as a whole, through the
worker's run arithmetic; every byte is compared, and no byte outside the
loaded blocks may change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import MambaSpec

from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.worker.pages import LayoutError, describe_layer, page_layout
from tests.support import ascend as a23
from tests.support import ascend030 as a30
from tests.support.ascend import FakeNpuBackend, make_worker
from tests.support.ascend030_specs import (
    BS,
    HEAD,
    HEADS,
    LAYERS,
    LORA,
    MX_BS,
    MX_DIM,
    MX_HEADS,
    NB,
    ROPE,
    SOURCE,
    TARGET,
    VLLM_HAS_030_SPECS,
    config_of,
    fingerprint,
    gqa_spec,
    mxfp_spec,
    packed_mla,
)
from tests.support.connector import settings as store_settings

# vllm-ascend 0.30 runs on vLLM 0.30: its specs' fields (page_size_padded,
# state_content_bytes, kv_quant_mode) are not in vLLM 0.23's
pytestmark = pytest.mark.skipif(
    not VLLM_HAS_030_SPECS,
    reason="vLLM before 0.30 has none of the spec fields vllm-ascend 0.30 sets",
)


def through_a_worker(tmp_path, config, make, groups=(0,), checked=None) -> None:
    a23.worker_round_trip(tmp_path, config, make, SOURCE, TARGET, groups, checked)


# -- GQA: K and V interleaved in one allocation ---------------------------------------


def mrv1_combined(seed: int, dtype=torch.bfloat16) -> a30.Registration:
    elem = torch.empty(0, dtype=dtype).element_size()
    owner, raw = a30.aligned_int8(NB * 2 * BS * HEADS * HEAD * elem, seed)
    return a30.Registration(a30.combined_kv(raw, NB, BS, HEADS, HEAD, dtype), [owner])


def test_mrv1_interleaved_kv_is_read_from_strides():
    """model_runner_v1.py:5720-5744: k and v are views of one buffer with
    stride (2 * page_half, ...): block b's K at 2*b*half, its V right after.
    Shape alone would put block b at b*half: another block's bytes."""
    reg = mrv1_combined(1)
    k, v = reg.value
    half = BS * HEADS * HEAD * 2
    assert k.stride(0) * 2 == 2 * half
    assert v.data_ptr() - k.data_ptr() == half
    layout = describe_layer(LAYERS[0], reg.value, NB)
    assert [(s.base_ptr - k.data_ptr(), s.block_stride) for s in layout.segments] == [
        (0, 2 * half),
        (half, 2 * half),
    ]
    a30.ring_round_trip({LAYERS[0]: reg}, {LAYERS[0]: layout}, SOURCE, TARGET)


def test_interleaved_kv_through_a_worker(tmp_path):
    config = config_of((LAYERS, gqa_spec()))
    through_a_worker(
        tmp_path,
        config,
        lambda s: {n: mrv1_combined(s + i) for i, n in enumerate(LAYERS)},
    )


def test_interleaved_pages_load_into_separate_buffers(tmp_path):
    """The page is canonical (K's block, then V's): saved from one
    allocation with K/V interleaved, loaded into vllm-ascend's separate
    (k, v) buffers (model_runner_v1.py:5850-5866) byte for byte."""
    config = config_of((LAYERS, gqa_spec()))
    shape = (NB, BS, HEADS, HEAD)

    def make(seed):
        if seed == 1:
            return {n: mrv1_combined(seed + i) for i, n in enumerate(LAYERS)}
        return {
            n: a30.separate([(shape, torch.bfloat16)] * 2, 10 * i)
            for i, n in enumerate(LAYERS)
        }

    through_a_worker(tmp_path, config, make)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
    heads=st.integers(1, 3),
    head=st.sampled_from([4, 8, 12]),
    kernel=st.sampled_from([2, 4]),
    rows=st.integers(1, 3),
    pad=st.sampled_from([None, 0, 8, 64, 300]),
    data=st.data(),
)
def test_random_interleavings_and_paddings_round_trip(
    dtype, heads, head, kernel, rows, pad, data
):
    """MRV1 (pad None) or MRV2 with padded pages (v2/attn_utils.py:687-722),
    ``rows`` kernel rows per vLLM block: byte-exact both ways, padding and
    other blocks untouched."""
    elem = torch.empty(0, dtype=dtype).element_size()
    hidden = kernel * heads * head * elem
    if pad is None and rows > 1:
        pad = 0  # MRV1's combined form has one kernel row per block
    page = None if pad is None else rows * (2 * hidden + pad * elem)
    owner, raw = a30.aligned_int8(
        NB * (page or 2 * hidden), data.draw(st.integers(0, 99))
    )
    value = a30.combined_kv(
        raw, NB, kernel, heads, head, dtype, page_stride_bytes=page, rows_per_block=rows
    )
    reg = a30.Registration(value, [owner])
    layout = page_layout("l", {"l": value}, NB, 2 * rows * hidden, rows_per_block=rows)
    blocks = data.draw(
        st.lists(st.integers(0, NB - 1), min_size=1, max_size=4, unique=True)
    )
    targets = data.draw(st.permutations(range(NB)))[: len(blocks)]
    a30.ring_round_trip({"l": reg}, {"l": layout}, blocks, targets, rows)


# -- one backing tensor for a hybrid; padded pages ------------------------------------

CONV, SSM = (3, 8), (2, 4, 4)  # a Mamba layer's states (fp32)


def hybrid_backing(seed: int, padded: int):
    """MRV2's hybrid (v2/attn_utils.py:960-1040): one backing buffer that
    both groups overlay from byte 0, layer i of each group at i * layer
    size; attention views stride the padded page (:687-722), Mamba states
    pack into it (``_reshape_mamba_kv_cache``, :1281-1298)."""
    layer_bytes = NB * padded
    owner, raw = a30.aligned_int8(2 * layer_bytes, seed)
    attention, states = {}, {}
    for i in range(2):
        own = raw[i * layer_bytes : (i + 1) * layer_bytes]
        kv = a30.combined_kv(
            own, NB, BS, HEADS, HEAD, torch.bfloat16, page_stride_bytes=padded
        )
        attention[f"model.layers.{2 * i}.self_attn.attn"] = a30.Registration(
            kv, [owner]
        )
        mamba = a30.page_strided(
            own, [(NB, *CONV), (NB, *SSM)], [torch.float32] * 2, padded
        )
        states[f"model.layers.{2 * i + 1}.linear_attn"] = a30.Registration(
            mamba, [owner]
        )
    return attention, states


def test_one_backing_tensor_for_a_hybrid():
    """Attention pages padded to the Mamba page (model_runner_v1.py:
    6335-6343; vLLM's page_size_padded): the namespace stores the unpadded
    page (the padding is no KV), the worker finds exactly it in both
    groups' views of the shared buffer, and blocks of the two groups (a
    block id belongs to one group at a time) round-trip byte-exact."""
    unpadded = 2 * BS * HEADS * HEAD * 2
    padded = unpadded + 96
    state_bytes = 4 * (3 * 8 + 2 * 4 * 4)
    attn, states = hybrid_backing(3, padded)
    mamba = MambaSpec(
        block_size=BS, shapes=(CONV, SSM), dtypes=(torch.float32,) * 2,
        page_size_padded=padded, mamba_cache_mode="align",
    )  # fmt: skip
    engine = engine_namespaces(
        *config_of(
            (list(attn), gqa_spec(page_size_padded=padded)), (list(states), mamba)
        ),
        store_settings(Path("/nonexistent")),
    )
    rows = {
        layer.name: layer.row_bytes for spec in engine.specs[0] for layer in spec.layers
    }
    assert set(rows.values()) == {unpadded, state_bytes}
    caches = {n: r.value for n, r in {**attn, **states}.items()}
    layouts = {n: page_layout(n, caches, NB, rows[n]) for n in caches}
    assert {s.block_stride for lay in layouts.values() for s in lay.segments} == {
        padded
    }
    a30.ring_round_trip(attn, layouts, [1, 4], [6, 3])
    attn, states = hybrid_backing(3, padded)
    caches = {n: r.value for n, r in {**attn, **states}.items()}
    layouts = {n: page_layout(n, caches, NB, rows[n]) for n in caches}
    a30.ring_round_trip(states, layouts, [2, 8], [11, 0])


def test_a_hybrid_backing_tensor_through_a_worker(tmp_path):
    """The same shared buffer through real workers on a fake NPU: the
    attention group's blocks saved and loaded byte-exact, the Mamba layers
    (registered in the same bytes) untouched."""
    padded = 2 * BS * HEADS * HEAD * 2 + 96
    attn, states = hybrid_backing(0, padded)
    mamba = MambaSpec(
        block_size=BS, shapes=(CONV, SSM), dtypes=(torch.float32,) * 2,
        page_size_padded=padded, mamba_cache_mode="align",
    )  # fmt: skip
    config = config_of(
        (list(attn), gqa_spec(page_size_padded=padded)), (list(states), mamba)
    )

    def make(seed):
        attention, recurrent = hybrid_backing(seed, padded)
        return {**attention, **recurrent}

    through_a_worker(tmp_path, config, make, checked=set(attn))


def test_a_padded_page_keeps_the_unpadded_keys():
    """Padding is not data: the same layers padded or not share a namespace,
    so an engine whose page is padded finds the blocks an unpadded one saved."""
    assert fingerprint((LAYERS, gqa_spec())) == fingerprint(
        (LAYERS, gqa_spec(page_size_padded=4096))
    )


# -- C8-MXFP: FP8 K/V with E8M0 scales in one packet per block ------------------------


def mxfp_layer(seed: int, pitch: int) -> a30.Registration:
    owner, raw = a30.aligned_int8(NB * pitch, seed)
    views = a30.mxfp_views(raw, NB, MX_HEADS, MX_DIM, MX_DIM, MX_BS, pitch=pitch)
    return a30.Registration(views, [owner])


def test_c8_mxfp_packets_through_a_worker(tmp_path):
    """(K, V, K scale, V scale) of packets [K | Ks | V | Vs | pad]: tuple
    order is not address order, the page is the four in tuple order, and
    every byte, the E8M0 scales included, comes back."""
    payload = sum(a30.mxfp_sections(MX_HEADS, MX_BS, MX_DIM, MX_DIM))
    pitch = payload + 512
    spec = mxfp_spec(page_size_padded=pitch)
    assert spec.real_page_size_bytes == payload
    layers = LAYERS[:2]
    config = config_of((layers, spec))
    through_a_worker(
        tmp_path,
        config,
        lambda s: {n: mxfp_layer(s + i, pitch) for i, n in enumerate(layers)},
    )


# -- per-layer dtypes, non-uniform page sizes ----------------------------------------


def test_per_layer_dtypes_and_page_sizes_through_a_worker(tmp_path):
    """A per-layer group (kv_cache_dtype_skip_layers: fp8 layers beside a
    bf16 one, and a layer of other heads) and a second group of another
    page size: each layer's own page, byte-exact."""
    heads = {LAYERS[0]: 2, LAYERS[1]: 2, LAYERS[2]: 1}
    dtypes = {LAYERS[0]: torch.float8_e4m3fn, LAYERS[1]: torch.bfloat16}
    dtypes[LAYERS[2]] = torch.float8_e4m3fn
    specs = {n: gqa_spec(dtype=dtypes[n], num_kv_heads=heads[n]) for n in LAYERS}
    other = ["model.layers.3.self_attn.attn"]
    config = config_of((LAYERS, a23.per_layer(specs)), (other, gqa_spec(head_size=4)))
    engine = engine_namespaces(*config, store_settings(tmp_path))
    assert (
        "layers=float8_e4m3fn[]|bfloat16[]|float8_e4m3fn[]" in engine.specs[0][0].extra
    )

    def make(seed):
        regs = {
            n: a30.separate([((NB, BS, heads[n], HEAD), dtypes[n])] * 2, seed * 10 + i)
            for i, n in enumerate(LAYERS)
        }
        regs[other[0]] = a30.separate([((NB, BS, HEADS, 4), torch.bfloat16)] * 2, seed)
        return regs

    through_a_worker(tmp_path, config, make, groups=(0, 1))


# -- C8 and INT4 latents with their scales; page-strided MLA ---------------------------


@pytest.mark.parametrize("form", ["c8", "tq4"])
def test_packed_latents_with_scales_through_a_worker(tmp_path, form):
    """The packed main cache registers as a 1-tuple [B, bs, 1, slot] of int8
    (model_runner_v1.py:5848-5863; MRV2 v2/attn_utils.py:1631-1639): the
    packed values and their scales are one opaque slot per token."""
    spec = packed_mla(form)
    config = config_of((LAYERS, spec))
    config[0].model_config.use_mla = True
    slot = spec.head_size
    through_a_worker(
        tmp_path,
        config,
        lambda s: {
            n: a30.separate([((NB, BS, 1, slot), torch.int8)], 7 * s + i)
            for i, n in enumerate(LAYERS)
        },
    )


def test_c8_indexer_key_and_scale_round_trip():
    """The SFA indexer's C8 key and its scale: two buffers (int8 key, fp16
    scale; model_runner_v1.py:5551-5593), or one page-strided buffer whose
    third view overlaps both (DeepSeek V4.1's ``full``, :5513-5550): the
    covering view is dropped and the key and scale stored once."""
    key, scale = ((NB, BS, 1, 32), torch.int8), ((NB, BS, 1, 1), torch.float16)
    two = a30.separate([key, scale], 40)
    layout = describe_layer("idx", two.value, NB)
    assert layout.page_bytes == BS * (32 + 2)
    a30.ring_round_trip({"idx": two}, {"idx": layout}, [3, 11], [4, 5])
    page = BS * (32 + 2) + 64
    owner, raw = a30.aligned_int8(NB * page, 41)
    full_shape = (NB, BS, 1, 32 + 2)
    views = a30.page_strided(
        raw, [key[0], scale[0], full_shape], [torch.int8, torch.float16, torch.int8],
        page, overlap_full=True,
    )  # fmt: skip
    reg = a30.Registration(tuple(views), [owner], data_members=(0, 1))
    layout = describe_layer("idx", reg.value, NB)
    assert "dropped" in layout.kind
    assert layout.page_bytes == BS * (32 + 2)
    a30.ring_round_trip({"idx": reg}, {"idx": layout}, [0, 6], [9, 1])


def test_page_strided_mla_nope_rope_round_trip():
    """``indexes_kv_by_block_stride`` MLA (model_runner_v1.py:5477-5550):
    nope and rope as two dtype views of one page-strided buffer; and MRV2's
    combined MLA (v2/attn_utils.py:1648-1659): contiguous nope then rope
    planes after leading padding."""
    page = BS * (LORA + ROPE) * 2 + 128
    owner, raw = a30.aligned_int8(NB * page, 50)
    views = a30.page_strided(
        raw, [(NB, BS, 1, LORA), (NB, BS, 1, ROPE)], [torch.bfloat16] * 2, page
    )
    reg = a30.Registration(tuple(views), [owner])
    layout = describe_layer("mla", reg.value, NB)
    a30.ring_round_trip({"mla": reg}, {"mla": layout}, [1, 2, 3], [3, 2, 1])
    pad = 256
    owner, raw = a30.aligned_int8(pad + NB * BS * (LORA + ROPE) * 2, 51)
    typed = raw.view(torch.bfloat16)
    k_el = NB * BS * LORA
    start = pad // 2
    nope = typed[start : start + k_el].view(NB, BS, 1, LORA)
    rope = typed[start + k_el :].view(NB, BS, 1, ROPE)
    reg = a30.Registration((nope, rope), [owner])
    layout = describe_layer("mla", reg.value, NB)
    a30.ring_round_trip({"mla": reg}, {"mla": layout}, [0, 11], [5, 6])


def test_fa_quant_c8_mla_is_refused_not_stored(tmp_path):
    """vllm-ascend's per-layer C8 for MLA (FA quant): the spec keeps the
    bf16 page (model_runner_v1.py:6238-6240) while K is registered int8
    beside a bf16 rope (:5848-5866, quant_config.get_kv_quant_dtype): the
    members do not add up to the spec's page, and the worker turns the
    connector off with one line naming the layer and both sizes."""
    from npukv_store.connector.worker.side import WorkerSide

    spec = a23.AscendMLAAttentionSpec030(
        block_size=BS, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.bfloat16
    )
    config = config_of((LAYERS, spec))
    config[0].model_config.use_mla = True
    members = [((NB, BS, 1, LORA), torch.int8), ((NB, BS, 1, ROPE), torch.bfloat16)]
    caches = {n: a30.separate(members, i).value for i, n in enumerate(LAYERS)}
    worker = WorkerSide(*config, store_settings(tmp_path))
    worker.register(caches)
    found, expected = BS * (LORA + 2 * ROPE), BS * (LORA + ROPE) * 2
    assert f"block page of {found} bytes" in worker.disabled_reason
    assert f"expected {expected} bytes" in worker.disabled_reason
    assert "\n" not in worker.disabled_reason
    worker.close()


def test_mxfp_kernel_rows_other_than_128_token_ones_are_refused():
    """C8-MXFP's kernel block is 512 tokens (attention_c8_mxfp.py:397-399):
    a vLLM block of 1024 is 2 packets, where the worker's kernel-block rule
    (128-token rows, several groups) tries 8 rows: refused, never stored."""
    payload = sum(a30.mxfp_sections(MX_HEADS, MX_BS, MX_DIM, MX_DIM))
    owner, raw = a30.aligned_int8(2 * NB * payload, 60)
    views = a30.mxfp_views(raw, 2 * NB, MX_HEADS, MX_DIM, MX_DIM, MX_BS)
    caches = {"l": views}
    with pytest.raises(LayoutError, match="nor with 8 rows per block|and with 8 rows"):
        page_layout("l", caches, NB, 2 * payload, rows_per_block=8)
    assert page_layout("l", caches, NB, 2 * payload, rows_per_block=2).page_bytes == (
        2 * payload
    )


# -- Model Runner V2's dict -----------------------------------------------------------


def test_model_runner_v2_dict_through_a_worker(tmp_path):
    """What MRV2 hands over (vLLM 0.30 gpu/kv_connector.py:55-60 with
    vllm-ascend's ``_reshape_kv_cache_v2``, v2/attn_utils.py:1301-1680):
    padded combined (k, v) per layer, plus entries for KV-sharing layers
    that alias another layer's tuple (:1678-1679) and are in no group."""
    unpadded = 2 * BS * HEADS * HEAD * 2
    padded = unpadded + 128

    def make(seed):
        regs = {}
        for i, name in enumerate(LAYERS):
            owner, raw = a30.aligned_int8(NB * padded, seed * 10 + i)
            kv = a30.combined_kv(
                raw, NB, BS, HEADS, HEAD, torch.bfloat16, page_stride_bytes=padded
            )
            regs[name] = a30.Registration(kv, [owner])
        return regs

    config = config_of((LAYERS, gqa_spec(page_size_padded=padded)))
    source = make(1)
    value = {n: r.value for n, r in source.items()}
    value["model.layers.3.self_attn.attn"] = value[LAYERS[0]]  # a sharing layer
    worker = make_worker(tmp_path, config, value, FakeNpuBackend(), layerwise="off")
    assert [lay.layout.page_bytes for lay in worker.layers] == [unpadded] * 3
    worker.close()
    through_a_worker(tmp_path, config, make)
