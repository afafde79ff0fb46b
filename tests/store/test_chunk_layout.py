"""ChunkLayout: the one source of a chunk file's offsets, used by the header
encoder, the saver's ring image and the reader's check of a file."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.errors import CorruptChunk
from npukv_store.spec import LayerSpec, NamespaceSpec, PartSpec
from npukv_store.store.format import ChunkLayout, build_chunk, encode_header
from npukv_store.store.format_checks import parse_header
from npukv_store.store.write import staging as saver


@st.composite
def specs(draw):
    layers = []
    for i in range(draw(st.integers(1, 4))):
        parts = tuple(
            PartSpec(
                f"p{j}",
                draw(st.sampled_from(["F16", "U8", "F32"])),
                (draw(st.integers(1, 9)), draw(st.integers(1, 5))),
            )
            for j in range(draw(st.integers(1, 3)))
        )
        layers.append(LayerSpec(f"layer{i}", parts))
    return NamespaceSpec(model="m", block_size=4, kv_dtype="x", layers=tuple(layers))


def _keys(n):
    return [i.to_bytes(16, "little") for i in range(1, n + 1)]


@settings(max_examples=40, deadline=None)
@given(spec=specs(), n=st.integers(1, 12))
def test_the_header_places_every_tensor_where_the_layout_says(
    tmp_path_factory, spec, n
):
    keys = _keys(n)
    rng = np.random.default_rng(n)
    rows = {
        name: memoryview(rng.integers(0, 256, n * p.row_bytes, dtype=np.uint8))
        for name, p in zip(
            spec.tensor_names(),
            [p for layer in spec.layers for p in layer.parts],
            strict=True,
        )
    }
    buffers = build_chunk(spec, "ab" * 16, keys, rows, creator="1@h", created_ns=7)
    path = str(tmp_path_factory.mktemp("c") / "c.safetensors")
    with open(path, "wb") as handle:
        for buffer in buffers:
            handle.write(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        header = parse_header(fd, path, spec=spec)  # checks the offsets too
    finally:
        os.close(fd)
    layout = ChunkLayout(spec, n, header.data_start)
    entries = [e for layer in header.layers for e in layer]
    parts = layout.parts()
    assert [(e.begin, e.end) for e in entries] == [
        (layout.data_start + p.begin, layout.data_start + p.end) for p in parts
    ]
    assert layout.file_size == header.file_size == os.path.getsize(path)
    for index in range(len(spec.layers)):
        first = next(p for p in parts if p.layer_index == index)
        assert layout.layer_offset(index) == layout.data_start + first.begin

    # The saver's in-place image (data copied in, checksums filled) is the file.
    header_bytes = encode_header(spec, "ab" * 16, keys, creator="1@h", created_ns=7)
    image = np.zeros(layout.file_size, np.uint8)
    image[: len(header_bytes)] = np.frombuffer(header_bytes, np.uint8)
    for part, name in zip(parts, spec.tensor_names(), strict=True):
        start = layout.data_start + part.begin
        image[start : layout.data_start + part.end] = np.frombuffer(
            rows[name], np.uint8
        )
    saver._fill_checksums(image, layout)
    with open(path, "rb") as handle:
        assert image.tobytes() == handle.read()


def test_a_tensor_moved_inside_the_data_section_is_refused(tmp_path):
    """A header whose tensors tile the data section, but in another order than
    the namespace's layout, must not be read by the layout's offsets."""
    part = PartSpec("k", "U8", (8,))
    spec = NamespaceSpec(
        model="m", block_size=4, kv_dtype="x",
        layers=(LayerSpec("a", (part,)), LayerSpec("b", (part,))),
    )  # fmt: skip
    keys = _keys(2)
    header = encode_header(spec, "ab" * 16, keys, creator="1@h", created_ns=1)
    text = header[8:].decode()
    swapped = text.replace('"data_offsets":[0,16]', '"data_offsets":[X]')
    swapped = swapped.replace('"data_offsets":[16,32]', '"data_offsets":[0,16]')
    swapped = swapped.replace('"data_offsets":[X]', '"data_offsets":[16,32]')
    assert swapped != text
    assert len(swapped) == len(text)
    path = tmp_path / "c.safetensors"
    path.write_bytes(header[:8] + swapped.encode() + bytes(32 + 2 * 2 * 8))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptChunk, match="expected|tile|order"):
            parse_header(fd, str(path), spec=spec)
    finally:
        os.close(fd)
