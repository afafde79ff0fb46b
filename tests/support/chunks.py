"""Chunk files on disk: those of a cache directory, its tmp/ leftovers, the
largest chunk a namespace can write, the check that every chunk stays a plain
safetensors file, and for the read tests an aligned namespace, aligned output
buffers and the files' page-cache state."""

from __future__ import annotations

import os

import numpy as np
import pytest

from npukv_store import LayerSpec, NamespaceSpec, PartSpec
from npukv_store.hashing import namespace_fingerprint
from npukv_store.io.direct import aligned_buffer
from npukv_store.native import page_residency
from npukv_store.store.directory import HOST, CacheDir
from npukv_store.store.format import encode_header

BLOCKS = 64  # 1 MiB of data: the header read (64 KiB) caches little of it


def only_chunk(cache_dir: str, namespace: str) -> str:
    """The path of the one chunk file of ``namespace``."""
    chunks = os.path.join(cache_dir, namespace, "chunks")
    (name,) = os.listdir(chunks)
    return os.path.join(chunks, name)


def chunk_files(cache_dir: str) -> dict[int, str]:
    """chunk id -> path, over every namespace of ``cache_dir``."""
    cdir = CacheDir(cache_dir)
    return {
        cid: path
        for ns in cdir.namespaces()
        for cid, path in cdir.chunk_files(ns).items()
    }


def chunk_bytes_on_disk(cache_dir: str) -> int:
    """Bytes of every chunk file in ``cache_dir`` (files may vanish meanwhile)."""
    total = 0
    for path in chunk_files(cache_dir).values():
        try:
            total += os.stat(path).st_size
        except FileNotFoundError:
            continue  # evicted between listdir and stat
    return total


def tmp_files(cache_dir: str) -> list[str]:
    """Names in ``cache_dir/tmp`` (in-flight writes and their crash leftovers)."""
    try:
        return sorted(os.listdir(os.path.join(cache_dir, "tmp")))
    except FileNotFoundError:
        return []


def max_chunk_bytes(spec: NamespaceSpec, num_blocks: int) -> int:
    """An upper bound of the file size of a chunk of ``num_blocks`` blocks."""
    header = encode_header(
        spec,
        namespace_fingerprint(spec).hex(),
        [bytes(16)] * num_blocks,
        creator=f"{2**22}@{HOST}",  # longest pid: headers are padded anyway
        created_ns=2**63 - 1,
    )
    return len(header) + num_blocks * (spec.block_bytes + 8 * len(spec.layers))


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


# -- the read tests' aligned chunks and their page-cache state ----------------


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


def evict_from_page_cache(cache_dir: str) -> None:
    """Drop the (clean, fsynced) pages of every chunk file; skip where the
    filesystem keeps them regardless (tmpfs), since nothing is then cold."""
    for path in chunk_files(cache_dir).values():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if page_residency(fd, 0, os.fstat(fd).st_size).any():
                pytest.skip(
                    f"{os.path.dirname(path)} keeps file pages resident (tmpfs?)"
                )
        finally:
            os.close(fd)


def cached_share(cache_dir: str) -> float:
    pages = []
    for path in chunk_files(cache_dir).values():
        fd = os.open(path, os.O_RDONLY)
        try:
            pages.append(page_residency(fd, 0, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return float(np.concatenate(pages).mean())
