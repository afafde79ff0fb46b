"""The store namespaces of a vLLM engine: what makes its KV bytes compatible.

Runs in: EngineCore (scheduler side) and every Worker. Both sides must derive
the same fingerprints from the same configuration, so they use only what the
scheduler also knows: the model, the KV cache config (groups, layer names, page
sizes, layout), the platform, the vLLM minor version and the TP rank. The
worker then checks that the tensors it was given really have those page sizes.

One namespace per TP rank and KV cache group: a hybrid model's groups have
their own block tables and, for sliding-window groups, their own set of stored
blocks (see :mod:`.groups`), so their keys must never meet. The group's kind,
window and position are in the fingerprint: two layouts that differ only by
their group structure never share a block.

Each layer is stored as one part ``page``: the block's bytes, all of the
device runs of the layer concatenated (see
:mod:`npukv_store.connector.worker.pages`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.groups import KVGroup, classify
from npukv_store.connector.spec_classes import kv_form
from npukv_store.connector.vllm_api import (
    HANDS_OFF_BOUNDARY_STATES,
    VLLM_VERSION,
    kv_cache_layout,
)
from npukv_store.errors import UnsupportedSetup
from npukv_store.spec import LayerSpec, NamespaceSpec, PartSpec

PAGE_PART = "page"
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class EngineKV:
    """The KV cache groups of an engine and their namespaces."""

    groups: tuple[KVGroup, ...]
    #: ``specs[rank][group]``; a single rank when the KV is the same on every
    #: rank (MLA's latent cache)
    specs: tuple[tuple[NamespaceSpec, ...], ...]
    block_size: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def full_attention_only(self) -> bool:
        """Whether the remote tier serves this engine: its lookups follow
        full-attention chains only (:mod:`.scheduler.hits`), so blocks of
        sliding-window groups there would be found by no one."""
        return all(group.kind == "full" for group in self.groups)

    def rank_specs(self, rank: int) -> tuple[NamespaceSpec, ...]:
        return self.specs[rank if len(self.specs) > 1 else 0]


def engine_namespaces(
    vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
) -> EngineKV:
    """The engine's groups, with one NamespaceSpec per TP rank and group.

    Raises:
        UnsupportedSetup: a setup this connector does not serve (pipeline
            parallelism, a group kind without block-wise hits, groups of
            different block sizes, no attention layers).
    """
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedSetup(
            f"pipeline_parallel_size: found {parallel.pipeline_parallel_size}, "
            "expected 1 (npukv_store serves single-stage engines)"
        )
    _refuse_context_parallel(parallel)
    _refuse_kvpp(vllm_config)
    raw_groups = list(kv_cache_config.kv_cache_groups)
    if not raw_groups or not any(g.layer_names for g in raw_groups):
        raise UnsupportedSetup("KV cache layers: found none, expected attention layers")
    groups: list[KVGroup] = []
    pages: list[dict[str, int]] = []
    block_sizes: set[int] = set()
    for index, raw in enumerate(raw_groups):
        group, page_bytes = _describe_group(index, raw)
        groups.append(group)
        pages.append(page_bytes)
        block_sizes.add(int(_first_spec(raw.kv_cache_spec).block_size))
    if len(block_sizes) != 1:
        raise UnsupportedSetup(
            f"KV cache groups: found block sizes {sorted(block_sizes)}, expected "
            "one block size for every group"
        )
    (block_size,) = block_sizes
    base = _base_extra(vllm_config, kv_cache_config, settings)
    model = vllm_config.model_config
    mla = bool(getattr(model, "use_mla", False))
    tp_size = int(parallel.tensor_parallel_size)
    # The same local checkpoint named by another path (./model, a symlink) is
    # the same model: name it by its real path.
    name = str(model.model)
    if os.path.isdir(name):
        name = os.path.realpath(name)
    # the KV dtype of the attention layers (a Mamba group's are in its extra)
    kv_raw = next(
        (r for r, g in zip(raw_groups, groups, strict=True) if g.kind != "state"),
        raw_groups[0],
    )
    dtype = str(getattr(_first_spec(kv_raw.kv_cache_spec), "dtype", "")).removeprefix(
        "torch."
    )
    specs = tuple(
        tuple(
            NamespaceSpec(
                model=name,
                revision=str(model.revision or ""),
                block_size=block_size,
                kv_dtype=dtype,
                layers=tuple(
                    LayerSpec(layer, (PartSpec(PAGE_PART, "U8", (size,)),))
                    for layer, size in page_bytes.items()
                ),
                tp_rank=rank,
                tp_size=tp_size,
                rank_independent=mla,
                extra=(
                    f"{base};groups={len(groups)};group={group.index};"
                    f"kind={group.kind};tail={group.tail_tokens};"
                    f"spec={type(raw.kv_cache_spec).__name__}"
                    f"{_state_form(raw.kv_cache_spec) if group.kind == 'state' else ''}"
                    f"{_kv_forms(raw, dtype) if group.kind != 'state' else ''}"
                ),
            )
            for group, page_bytes, raw in zip(groups, pages, raw_groups, strict=True)
        )
        for rank in range(1 if mla else tp_size)
    )
    return EngineKV(tuple(groups), specs, block_size)


def _refuse_context_parallel(parallel: Any) -> None:
    """Context parallelism spreads each vLLM block over the ranks (a block
    holds block_size x dcp x pcp tokens, each rank its own slice, MLA's latent
    cache included): keyed as one rank's block_size tokens it would be wrong
    KV, so such an engine is refused on every vLLM version."""
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp * pcp > 1:
        raise UnsupportedSetup(
            f"context parallelism: found decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}, expected 1 and 1 (a block "
            "is split over the ranks, which npukv_store does not key)"
        )


def _refuse_kvpp(vllm_config: Any) -> None:
    """vllm-ascend's KVPP (``additional_config.enable_kvpp``, 0.30+) keeps
    each layer's KV on one TP rank only and registers every other layer as a
    view of a scratch buffer that the owner broadcasts into at execute time
    (vllm_ascend/worker/kvpp_cache.py: ``allocate_kvpp_cache``). A rank would
    save scratch bytes as those layers' KV, and MLA's one saving rank holds
    only its own layers: refused by name (decision 0068). The worker also
    refuses any two layers of one group that share bytes, whatever the flag
    is called (worker/layer_overlap.py)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    enabled = extra.get("enable_kvpp", False) if isinstance(extra, dict) else False
    if isinstance(enabled, str):
        enabled = enabled.strip().lower() in ("1", "true", "yes", "on")
    parallel = vllm_config.parallel_config
    ranks = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "prefill_context_parallel_size", 1) or 1
    )
    if enabled and ranks > 1:  # a group of one rank owns every layer: no KVPP
        raise UnsupportedSetup(
            f"vllm-ascend KVPP: found additional_config.enable_kvpp={enabled!r} "
            f"over {ranks} ranks, expected it off (each rank holds only its own "
            "layers' KV, which npukv_store does not assemble)"
        )


def model_order(layer_name: str) -> int:
    """Sort key: the layer's index in the model (the forward's order), the
    first integer part of its name as in vLLM's extract_layer_index (not
    imported: that module pulls in grpc and tvm_ffi, which made a test process
    abort at exit); names without one go last, in their order (sorts are
    stable)."""
    match = _LAYER_INDEX.search(layer_name)
    return int(match.group(1)) if match else 1 << 30


def _first_spec(kv_spec: Any) -> Any:
    """A group's spec, or the first layer's of a UniformTypeKVCacheSpecs (layers
    of one kind whose page sizes differ)."""
    per_layer = getattr(kv_spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else kv_spec


def _describe_group(index: int, raw: Any) -> tuple[KVGroup, dict[str, int]]:
    kv_spec = raw.kv_cache_spec
    names = tuple(raw.layer_names)
    first = _first_spec(kv_spec)
    per_layer = getattr(kv_spec, "kv_cache_specs", None)
    layer_specs = [per_layer[name] for name in names] if per_layer else [kv_spec]
    kind = classify(type(first).__name__, index, names, layer_specs)
    if kind == "state" and not HANDS_OFF_BOUNDARY_STATES:
        raise UnsupportedSetup(
            f"KV cache group {index} is {type(first).__name__} ({len(names)} "
            f"layer(s), e.g. {names[0]}): vLLM {VLLM_VERSION} hands no Mamba "
            "state blocks to a connector (kv_connector_block_state, expected "
            "vLLM 0.32+), and a state read by position may be another "
            "prefix's"
        )
    page_bytes = {
        name: _stored_page(per_layer[name] if per_layer else kv_spec, kind)
        for name in names
    }
    tail = 0
    if kind == "sliding":
        tail = (
            int(first.sliding_window)
            - 1
            + int(getattr(first, "extra_retained_tokens", 0))
        )
    elif kind == "state":
        tail = 1  # the state after the last token of the hit
    return KVGroup(index, kind, names, tail), page_bytes


def _stored_page(spec: Any, kind: str) -> int:
    """The bytes of a layer's block that are stored: its page without the
    padding a hybrid pads it with. A state page is padded to the attention
    page (MambaSpec.real_page_size_bytes); an attention page may be padded
    to a common page too (``page_size_padded``: vLLM's hybrid pages, and
    vllm-ascend 0.30's, model_runner_v1.py:6335-6343), its views then
    striding over the padding (v2/attn_utils.py:687-722). Unpadded pages
    keep their size, and so their keys."""
    if kind == "state" or getattr(spec, "page_size_padded", None) is not None:
        return int(spec.real_page_size_bytes)
    return int(spec.page_size_bytes)


def _kv_forms(raw: Any, kv_dtype: str) -> str:
    """What an attention group's bytes are beyond their size: its dtype where
    it is not the engine's ``kv_dtype`` (the first attention group's), and
    the format fields that are not plain (:func:`.spec_classes.kv_form`:
    quantization, packing, scales); each layer's where a per-layer group's
    layers differ (vllm-ascend's per-layer KV dtypes). "" for a plain group
    of the engine's dtype, so such an engine keeps the keys it had."""
    per_layer = getattr(raw.kv_cache_spec, "kv_cache_specs", None)
    specs = (
        [per_layer[name] for name in raw.layer_names]
        if per_layer
        else [raw.kv_cache_spec]
    )
    forms = [
        (str(getattr(s, "dtype", "")).removeprefix("torch."), kv_form(s)) for s in specs
    ]
    if len(set(forms)) > 1:
        return ";layers=" + "|".join(f"{d}[{f}]" for d, f in forms)
    ((group_dtype, form),) = set(forms)
    text = f";dtype={group_dtype}" if group_dtype != kv_dtype else ""
    return text + (f";form={form}" if form else "")


def _state_form(kv_spec: Any) -> str:
    """A Mamba group's state shapes and dtypes, for its namespace: two layouts
    of the same byte count (an fp32 against a bf16 SSM state of twice the
    heads) must never share a block."""
    spec = _first_spec(kv_spec)
    shapes = getattr(spec, "shapes", None)
    if shapes is None:
        return ""
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f";shapes={list(map(list, shapes))};dtypes={dtypes}"


def _base_extra(vllm_config: Any, kv_cache_config: Any, settings: StoreConfig) -> str:
    import vllm
    from vllm.platforms import current_platform

    layout = kv_cache_layout(kv_cache_config)
    vllm_minor = ".".join(vllm.__version__.split(".")[:2])
    return (
        f"platform={current_platform.device_type};layout={layout};"
        f"vllm={vllm_minor};user={settings.namespace_extra}"
    )
