"""Shared fixtures: a tiny namespace, a store per test, and check() at teardown."""

from __future__ import annotations

import os

import numpy as np
import pytest

from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec, StoreConfig


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


@pytest.fixture
def spec() -> NamespaceSpec:
    return tiny_spec()


@pytest.fixture
def config(tmp_path) -> StoreConfig:
    return StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")


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


@pytest.fixture
def store(config, spec):
    handle = KVStore(config, spec)
    yield handle
    problems = handle.check(verify_data=True)
    handle.close()
    assert problems == []
    assert_chunks_open_with_safetensors(config.cache_dir)  # raises on a bad file


@pytest.fixture(params=["avx2", "baseline"])
def hash_kernel(request):
    """Every instruction-set kernel of native/checksum.c this CPU can run: the
    xxh3 loops, and the streamed copies of pread_rows_xxh3 and copy_runs
    (avx2; the baseline has none and copies in place with memmove)."""
    from npukv_store import _native

    if request.param not in _native._hash_kernels():
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    before = _native._hash_kernel()
    _native._hash_kernel(request.param)
    try:
        yield request.param
    finally:
        _native._hash_kernel(before)
