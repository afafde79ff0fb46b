"""Fuzz the remote value decoder (npukv_store.remote.value.verify_value).

A remote value comes from whoever can reach the Mooncake pool, so its decoder
takes any bytes: it must return "" for the value as written and a reason for
every other input, and never raise (an exception in a load would be a crash,
not the miss that "any doubt is a miss" promises). 10^5+ inputs from a fixed
seed: bit flips, byte replacements, header fields set to extremes (the MAC
left as it was, or made again with the right key, which exercises the field
checks behind it), truncation and extension. A few seconds here; well under
a minute on a slow 2-core VM.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

import numpy as np

from npukv_store.remote.value import (
    PREFIX_BYTES,
    SUMS_OFFSET,
    VALUE_MAGIC,
    ValueLayout,
    encode_value,
    value_mac,
    verify_value,
)

SEED = 20240605
INPUTS = 120_000
MAC_KEY = bytes(range(32))
FP, KEY = b"\x11" * 16, b"\x22" * 16
#: layouts of 1 to 5 layers, one of them of unequal layers (the per-layer
#: checksum path) and one with a 1-byte layer
LAYOUTS = [
    ValueLayout((64,)),
    ValueLayout((128, 128)),
    ValueLayout((1, 255, 32)),
    ValueLayout((96,) * 5),
]

#: (offset, struct format) of every header field; checksums follow
FIELDS = {
    "magic": (0, "8s"),
    "format": (8, "<I"),
    "num_layers": (12, "<I"),
    "data_bytes": (16, "<Q"),
    "namespace": (24, "16s"),
    "key": (40, "16s"),
    "reserved": (56, "<Q"),
    "mac": (64, "16s"),
}
EXTREMES = {
    "I": [0, 1, 2, 3, 5, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF],
    "Q": [0, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1],
    "s": [b"\x00", b"\xff", b"A", VALUE_MAGIC[:1]],
}


def resign(layout: ValueLayout, value: np.ndarray) -> None:
    """Make ``value``'s MAC again over what it now holds, in place."""
    raw = value.tobytes()
    mac = value_mac(MAC_KEY, raw[:PREFIX_BYTES], raw[SUMS_OFFSET : layout.header_bytes])
    value[PREFIX_BYTES:SUMS_OFFSET] = np.frombuffer(mac, np.uint8)


def mutations(
    rng: np.random.Generator, layout: ValueLayout, good: np.ndarray
) -> Iterator[tuple[str, np.ndarray]]:
    """Endless (kind, mutated copy of ``good``)."""
    size = good.size
    kinds: list[Callable[[], tuple[str, np.ndarray]]] = []

    def bit_flips() -> tuple[str, np.ndarray]:
        value = good.copy()
        for _ in range(int(rng.integers(1, 9))):
            value[int(rng.integers(size))] ^= np.uint8(1 << int(rng.integers(8)))
        return "bit flips", value

    def header_bit_flip() -> tuple[str, np.ndarray]:
        value = good.copy()  # the header is small: flip there often
        value[int(rng.integers(layout.header_bytes))] ^= np.uint8(
            1 << int(rng.integers(8))
        )
        return "header bit flip", value

    def byte_replacements() -> tuple[str, np.ndarray]:
        value = good.copy()
        count = int(rng.integers(1, 17))
        where = rng.integers(size, size=count)
        value[where] = rng.integers(0, 256, count, dtype=np.uint8)
        return "byte replacements", value

    def field_extreme() -> tuple[str, np.ndarray]:
        value = good.copy()
        name = list(FIELDS)[int(rng.integers(len(FIELDS)))]
        if rng.integers(4) == 0:  # a checksum instead
            index = int(rng.integers(layout.num_layers))
            offset, fmt = SUMS_OFFSET + 8 * index, "<Q"
            name = "checksum"
        else:
            offset, fmt = FIELDS[name]
        code = fmt[-1]
        choice = EXTREMES[code][int(rng.integers(len(EXTREMES[code])))]
        if code == "s":
            width = struct.calcsize(fmt)
            packed = bytes(choice) * width
        else:
            packed = struct.pack(fmt, choice)
        value[offset : offset + len(packed)] = np.frombuffer(packed, np.uint8)
        resigned = name != "mac" and bool(rng.integers(2))
        if resigned:
            resign(layout, value)
        return f"{name} extreme{' (MAC made again)' if resigned else ''}", value

    def resized() -> tuple[str, np.ndarray]:
        change = int(rng.integers(-size, 3 * size + 1))
        new = max(0, size + change) if change else size + 1
        value = np.zeros(new, np.uint8)
        keep = min(new, size)
        value[:keep] = good[:keep]
        if new > size:
            value[size:] = rng.integers(0, 256, new - size, dtype=np.uint8)
        return "truncated or extended", value

    def data_swap() -> tuple[str, np.ndarray]:
        # two different data bytes exchanged: same bytes, same length
        value = good.copy()
        data = value[layout.header_bytes :]
        i, j = (int(x) for x in rng.integers(data.size, size=2))
        data[i], data[j] = data[j], data[i]
        return "data bytes swapped", value

    kinds = [
        bit_flips, header_bit_flip, byte_replacements, field_extreme, resized,
        data_swap,
    ]  # fmt: skip
    while True:
        yield kinds[int(rng.integers(len(kinds)))]()


def test_fuzzed_values_are_a_reason_never_an_exception(attack):
    rng = np.random.default_rng(SEED)
    goods = []
    for layout in LAYOUTS:
        layers = [rng.bytes(n) for n in layout.layer_bytes]
        good = np.frombuffer(
            encode_value(layout, FP, KEY, layers, mac_key=MAC_KEY), np.uint8
        ).copy()
        with attack("remote value fuzz: the untouched value"):
            assert verify_value(layout, FP, KEY, good, mac_key=MAC_KEY) == ""
        goods.append((layout, good, mutations(rng, layout, good)))
    seen: dict[str, int] = {}
    for n in range(INPUTS):
        layout, good, source = goods[n % len(goods)]
        kind, value = next(source)
        unchanged = value.size == good.size and np.array_equal(value, good)
        seen[kind] = seen.get(kind, 0) + 1
        with attack("remote value fuzz: mutated value"):
            why = verify_value(layout, FP, KEY, value, mac_key=MAC_KEY)
            assert isinstance(why, str)
            if unchanged:  # a swap of equal bytes, a replacement by the same
                assert why == "", f"{kind}: the value as written refused: {why}"
            else:
                assert why, f"{kind} (#{n}, seed {SEED}): a changed value verified"
    # every kind ran, and the field checks behind the MAC were reached
    assert len(seen) >= 6, seen
    assert sum(v for k, v in seen.items() if "MAC made again" in k) > 5_000, seen
