"""Every KV cache spec class of vLLM 0.23, 0.32 and 0.33 and of vllm-ascend
0.23.0.post1, by name: served as full or sliding-window attention or as a
recurrent state at block boundaries, or refused with the reason
(docs/vllm.md, "KV cache spec classes", is this table).

Runs in: EngineCore and every Worker (through :mod:`.groups`). Pure data and
field checks over duck-typed spec objects: no vLLM import.

    SPEC_CLASSES    - class name -> SpecRule (the kind served, or why not)
    field_mismatch()  - why a spec of a served class is not in its served form

By name, not isinstance: a subclass (RSWASpec of FullAttentionSpec,
HiddenStateCacheSpec of MLAAttentionSpec) frees or reuses blocks in its own
way, so it is served only once it has been read and listed here. A class
not listed (a later vLLM's) is refused with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

GroupKind = Literal["full", "sliding", "state"]

_ALL = "0.23, 0.32, 0.33"


@dataclass(frozen=True, slots=True)
class SpecRule:
    """How the connector treats one spec class."""

    kind: GroupKind | None  # None: refused
    versions: str  # where the class exists ("ascend": vllm-ascend 0.23.0.post1)
    why: str  # served: what it reduces to; refused: the reason, for the log line


SPEC_CLASSES: dict[str, SpecRule] = {
    "FullAttentionSpec": SpecRule(
        "full",
        _ALL,
        "full attention: a hit at block e needs blocks [0, e); refused with "
        "non_causal=True (a prefix LM: a prompt token's KV depends on later "
        "tokens, and vLLM turns prefix caching off)",
    ),
    "MLAAttentionSpec": SpecRule(
        "full",
        _ALL,
        "MLA full attention, one latent page per block (also DeepSeek-V3.2's "
        "indexer cache on vLLM, an MLAAttentionSpec in the same group: stored "
        "and loaded with the latent, in the same chunk rows)",
    ),
    "TQFullAttentionSpec": SpecRule(
        "full",
        "0.23",
        "full attention with TurboQuant pages (FullAttentionManager; pages are "
        "opaque bytes, the spec class is part of the namespace)",
    ),
    "SinkFullAttentionSpec": SpecRule(
        "full",
        _ALL,
        "full attention: the sink tokens sit in fixed blocks that are in no "
        "request's block table; a request's own blocks are full attention's",
    ),
    "AscendMLAAttentionSpec": SpecRule(
        "full",
        "ascend",
        "MLA full attention with compress_ratio 1: plain (the nope + rope "
        "page, no scale part), or DeepSeek-V3.2's sparse form, whose page is "
        "the latent and the indexer key of each block, with or without C8 "
        "(groups.ascend_mla_mismatch)",
    ),
    "SlidingWindowSpec": SpecRule(
        "sliding",
        _ALL,
        "a hit needs the window's tail: window - 1 + extra_retained_tokens "
        "tokens before its end",
    ),
    "SlidingWindowMLASpec": SpecRule(
        "sliding",
        _ALL,
        "as SlidingWindowSpec; refused with bounded_replay=True (vLLM replays "
        "the window instead of caching it)",
    ),
    "ChunkedLocalAttentionSpec": SpecRule(
        None,
        _ALL,
        "chunked local attention (Llama 4): a hit needs the blocks from its "
        "chunk's start, a tail aligned to attention_chunk_size that no "
        "end-to-end test here has checked yet",
    ),
    "RSWASpec": SpecRule(
        None,
        "0.32, 0.33",
        "a generated token's KV depends on where the prompt ended (it sees the "
        "prompt and the last rswa_window generated tokens), and vLLM frees a "
        "middle gap of blocks: not a function of the token prefix",
    ),
    "CircularBufferSpec": SpecRule(
        None,
        "0.32, 0.33",
        "one ring block per request, never prefix-cached (prefix_cacheable "
        "is False): per-request scratch, not KV blocks of a prefix",
    ),
    "MambaSpec": SpecRule(
        "state",
        _ALL,
        "Mamba or linear-attention state (Qwen3-Next, Qwen3.5, Nemotron-H, "
        "Jamba, ...): one state per block boundary, as vLLM's "
        "mamba_cache_mode='align' keeps it; a hit at block e needs the state "
        "at e (the block e-1 holds it). Saved only from the exact blocks vLLM "
        "hands over (boundary_state_offloads, vLLM 0.32+); refused on vLLM "
        "0.23, with another cache mode or with speculative blocks",
    ),
    "HiSparseHotSpec": SpecRule(
        None,
        "0.32, 0.33",
        "HiSparse's hot buffer: blocks in a host pool with block ids of its "
        "own, and vLLM marks the group enable_kv_transfer=False",
    ),
    "HiSparseResidentSpec": SpecRule(
        None,
        "0.32, 0.33",
        "HiSparse's resident buffer: as HiSparseHotSpec",
    ),
    "HiddenStateCacheSpec": SpecRule(
        None,
        _ALL,
        "a cache-only layer of hidden states for speculative decoding "
        "(extract_hidden_states), not attention KV; not checked",
    ),
    "EncoderOnlyAttentionSpec": SpecRule(
        None,
        _ALL,
        "encoder-only attention holds no KV between steps (vLLM adds these "
        "layers after the connector starts; refused if one is ever seen)",
    ),
    "CrossAttentionSpec": SpecRule(
        None,
        _ALL,
        "cross-attention KV is the encoder's output, not a prefix of the "
        "prompt, and vLLM never prefix-caches it",
    ),
    "AscendSlidingWindowMLASpec": SpecRule(
        None,
        "ascend",
        "DeepSeek V4's sliding-window MLA cache (vllm-ascend), which comes "
        "with compressed and sparse MLA groups; its layout is not checked",
    ),
}

#: A group that holds layers of several classes: each layer is checked
#: (namespace.py unwraps it), so it is in no row of its own.
PER_LAYER_WRAPPER = "UniformTypeKVCacheSpecs"


def field_mismatch(spec_class: str, spec: Any) -> str:
    """Why ``spec`` (of a served class) is not in the form that is served;
    "" when it is. Fields a version lacks read as their plain defaults."""
    if spec_class == "MambaSpec":
        return _state_mismatch(spec)
    if getattr(spec, "non_causal", False):
        return "non_causal=True, expected False (a prefix LM's KV is not a prefix's)"
    if getattr(spec, "bounded_replay", False):
        return "bounded_replay=True, expected False (vLLM replays, not caches, it)"
    if getattr(spec, "prefix_cacheable", True) is False:
        return "prefix_cacheable=False, expected True (vLLM does not cache it)"
    per_state = getattr(spec, "tokens_per_state", 1)
    if per_state != 1:
        # DeepSeek V4's compressed MLA and its indexer (vLLM 0.32): a block
        # holds block_size / ratio states; only a CPU with AMX runs it here
        return (
            f"tokens_per_state={per_state}, expected 1 (one KV row per token; "
            "DeepSeek V4's compressed MLA is not proven end to end)"
        )
    return ""


def _state_mismatch(spec: Any) -> str:
    """A Mamba group is served in align mode only: there each block boundary
    vLLM caches holds the state of the prefix that ends there. In "none" mode
    (prefix caching off) one block holds the running state, and in "all" mode
    states are not on block boundaries. Speculative blocks (MTP) relocate
    state blocks inside the table every step: not checked here."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (
            f"mamba_cache_mode={mode!r}, expected 'align' (states on block "
            "boundaries: vLLM sets it when prefix caching is on)"
        )
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if spec_blocks:
        return (
            f"num_speculative_blocks={spec_blocks}, expected 0 (speculative "
            "decoding moves a Mamba group's state blocks; not served)"
        )
    return ""


#: Spec fields that say what a page's bytes mean (a quantization, a packing,
#: a scale layout, a split of K and V) where its size may say nothing, with
#: their plain values: a format change of the same page size must change the
#: namespace (SGLang's storage keys omitted the KV dtype:
#: sgl-project/sglang#33268). A field is named in the namespace only with a
#: value other than its plain ones, so an engine with plain KV keeps its keys.
FORM_FIELDS: dict[str, tuple[Any, ...]] = {
    # vLLM 0.32+: int8 / fp8 per token-head, int4, TurboQuant
    "kv_quant_mode": ("NONE",),
    # packed C (vllm-ascend 0.30's C8-MXFP: FP8 K/V and E8M0 scales)
    "state_content_bytes": (None,),
    "num_head_slots": (None,),
    # where K and V split a page of the same size (MLA: 0); see kv_form
    "head_size_v": (None, 0),
    "scale_dim": (None, 0),  # vllm-ascend: per-token scales in the page
    "cache_sparse_sfa_c8": (None, False),  # vllm-ascend: SFA's packed C8 latent
    # vllm-ascend 0.30: SFA's packed INT4 latent, rope and scale
    "cache_sparse_sfa_turboquant": (None, False),
    "cache_sparse_li_c8": (None, False),
    "cache_sparse_li_c4": (None, False),
    "cache_dtype_str": (None, "auto"),
    "model_version": (None,),  # DeepSeek V4 / GLM-5 page layouts
    "sfa_dcp_replicated_indexer_size": (None, 1),
}
#: dtypes of a quantized form's parts, named only beside one of the above
FORM_DTYPES = ("scale_dtype", "c8_k_cache_dtype", "c8_k_scale_cache_dtype")


def kv_form(spec: Any) -> str:
    """The format fields of ``spec`` whose values are not plain, as
    ``name=value`` joined by commas; "" for plain KV. Fields a version
    lacks count as plain."""
    parts = []
    for name, plain in FORM_FIELDS.items():
        value = getattr(spec, name, None)
        if name == "kv_quant_mode":
            value = getattr(value, "name", value)
        if name == "head_size_v" and value == getattr(spec, "head_size", None):
            continue  # K and V of one head size: the plain split
        # by type and value: True == 1 must not read as a plain 1
        if any(type(value) is type(p) and value == p for p in plain):
            continue
        parts.append(f"{name}={_text(value)}")
    if parts:
        parts += [
            f"{name}={_text(getattr(spec, name))}"
            for name in FORM_DTYPES
            if hasattr(spec, name)
        ]
    return ",".join(parts)


def _text(value: Any) -> str:
    return str(value).removeprefix("torch.")
