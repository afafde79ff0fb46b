"""Test blocks: a tiny namespace, deterministic block contents, and a check
that chunk files stay plain safetensors."""

from __future__ import annotations

import os

import numpy as np

from npukv_store import LayerSpec, NamespaceSpec, PartSpec


def tiny_spec(num_layers: int = 3, model: str = "tiny-llama", **kw) -> NamespaceSpec:
    """3 layers of k/v F16 [16 tokens, 2 heads, 8 dims]: 512 B per part per block."""
    parts = (PartSpec("k", "F16", (16, 2, 8)), PartSpec("v", "F16", (16, 2, 8)))
    layers = tuple(
        LayerSpec(f"model.layers.{i}.attn", parts) for i in range(num_layers)
    )
    return NamespaceSpec(
        model=model, block_size=16, kv_dtype="float16", layers=layers, **kw
    )


def block_tensors(spec: NamespaceSpec, keys: list[bytes]) -> dict[str, np.ndarray]:
    """Deterministic content per key, so any process can tell right from wrong."""
    out = {}
    for layer in spec.layers:
        for part in layer.parts:
            name = f"{layer.name}.{part.name}"
            rows = [
                np.random.default_rng(list(key + name.encode())).standard_normal(
                    part.row_shape
                )
                for key in keys
            ]
            out[name] = np.stack(rows).astype(np.float16)
    return out


def empty_like_blocks(spec: NamespaceSpec, n: int) -> dict[str, np.ndarray]:
    return {
        f"{lay.name}.{p.name}": np.zeros((n, *p.row_shape), np.float16)
        for lay in spec.layers
        for p in lay.parts
    }


def assert_chunks_open_with_safetensors(cache_dir: str) -> int:
    """Every chunk file a test wrote is a valid safetensors file whose tensors
    read back; returns how many were checked."""
    from safetensors import safe_open

    count = 0
    for root, _, files in os.walk(cache_dir):
        for name in files:
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(root, name), "np") as handle:
                    for key in handle.keys():  # noqa: SIM118 - not a dict
                        handle.get_tensor(key)
                count += 1
    return count
