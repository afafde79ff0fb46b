"""The store namespace of a vLLM engine: what makes its KV bytes compatible.

Runs in: EngineCore (scheduler side) and every Worker. Both sides must derive
the same fingerprint from the same configuration, so it uses only what the
scheduler also knows: the model, the KV cache config (layer names, page size,
layout), the platform, the vLLM minor version and the TP rank. The worker then
checks that the tensors it was given really have those page sizes.

Each layer is stored as one part ``page``: the block's bytes, all of the
device runs of the layer concatenated (see :mod:`npukv_store.layout`).
"""

from __future__ import annotations

import os
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.errors import ConfigError
from npukv_store.spec import LayerSpec, NamespaceSpec, PartSpec

PAGE_PART = "page"


def engine_namespaces(
    vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
) -> list[NamespaceSpec]:
    """One NamespaceSpec per TP rank (one in all for MLA, which is the same on
    every rank). Index ``r`` is rank ``r``'s namespace.

    Raises:
        ConfigError: a setup this connector does not serve (pipeline
            parallelism, several KV cache groups, no attention layers).
    """
    import vllm
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"pipeline_parallel_size: found {parallel.pipeline_parallel_size}, "
            "expected 1 (npukv_store serves single-stage engines)"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KV cache groups: found {len(groups)}, expected 1 (hybrid models "
            "are not supported yet)"
        )
    group = groups[0]
    kv_spec = group.kv_cache_spec
    page_bytes = int(kv_spec.page_size_bytes)
    layers = tuple(
        LayerSpec(name, (PartSpec(PAGE_PART, "U8", (page_bytes,)),))
        for name in group.layer_names
    )
    if not layers:
        raise ConfigError("KV cache layers: found none, expected attention layers")
    model = vllm_config.model_config
    layout = kv_cache_config.kv_cache_layout or ""
    vllm_minor = ".".join(vllm.__version__.split(".")[:2])
    extra = (
        f"platform={current_platform.device_type};layout={layout};"
        f"spec={type(kv_spec).__name__};vllm={vllm_minor};"
        f"user={settings.namespace_extra}"
    )
    mla = bool(getattr(model, "use_mla", False))
    tp_size = int(parallel.tensor_parallel_size)
    # The same local checkpoint named by another path (./model, a symlink) is
    # the same model: name it by its real path.
    name = str(model.model)
    if os.path.isdir(name):
        name = os.path.realpath(name)
    return [
        NamespaceSpec(
            model=name,
            revision=str(model.revision or ""),
            block_size=int(kv_spec.block_size),
            kv_dtype=str(kv_spec.dtype).removeprefix("torch."),
            layers=layers,
            tp_rank=rank,
            tp_size=tp_size,
            rank_independent=mla,
            extra=extra,
        )
        for rank in range(1 if mla else tp_size)
    ]
