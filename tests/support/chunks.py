"""Chunk files on disk for read tests: an aligned namespace, aligned output
buffers, the chunk files of a directory and their page-cache state."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from npukv_store import LayerSpec, NamespaceSpec, PartSpec
from npukv_store.io.direct import aligned_buffer
from npukv_store.native import page_residency

BLOCKS = 64  # 1 MiB of data: the header read (64 KiB) caches little of it


def aligned_spec():
    """Rows of exactly one 4096-byte page per part: [16 tokens, 8 heads, 16] F16."""
    parts = (PartSpec("k", "F16", (16, 8, 16)), PartSpec("v", "F16", (16, 8, 16)))
    layers = tuple(LayerSpec(f"layers.{i}", parts) for i in range(2))
    return NamespaceSpec(
        model="direct-reads", block_size=16, kv_dtype="float16", layers=layers
    )


def aligned_out(spec, rows: int, misalign: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for layer in spec.layers:
        for part in layer.parts:
            raw = aligned_buffer(rows * part.row_bytes + misalign)[misalign:]
            out[f"{layer.name}.{part.name}"] = raw.view(np.float16).reshape(
                rows, *part.row_shape
            )
    return out


def chunk_files(cache_dir: str) -> list[pathlib.Path]:
    return sorted(pathlib.Path(cache_dir).rglob("*.safetensors"))


def evict_from_page_cache(cache_dir: str) -> None:
    """Drop the (clean, fsynced) pages of every chunk file; skip where the
    filesystem keeps them regardless (tmpfs), since nothing is then cold."""
    for path in chunk_files(cache_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if page_residency(fd, 0, os.fstat(fd).st_size).any():
                pytest.skip(f"{path.parent} keeps file pages resident (tmpfs?)")
        finally:
            os.close(fd)


def cached_share(cache_dir: str) -> float:
    pages = []
    for path in chunk_files(cache_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            pages.append(page_residency(fd, 0, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return float(np.concatenate(pages).mean())
