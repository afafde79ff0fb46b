"""A fixed random tree of blocks for admission and eviction tests: a
request is the chain from the root to a node, as prefix-sharing prompts
are, and every block's bytes are a pure function of its id (a wrong byte
read back is caught)."""

from __future__ import annotations

import hashlib

import numpy as np

from npukv_store import LayerSpec, NamespaceSpec, PartSpec


class BlockTree:
    """``nodes`` blocks; node i's parent is below i (``-1``: a root), drawn
    from ``seed``; ``bushy`` divides the parents' ids (many chains then
    share short prefixes)."""

    def __init__(self, nodes: int, seed: int, row: int, bushy: int = 1) -> None:
        drawn = np.random.default_rng(seed).integers(0, range(1, nodes)) // bushy
        self.parent = [-1] + [int(p) for p in drawn]
        self.nodes, self.row = nodes, row
        parts = (PartSpec("k", "U8", (row,)), PartSpec("v", "U8", (row,)))
        self.spec = NamespaceSpec(
            model=f"block-tree-{seed}",
            block_size=16,
            kv_dtype="float16",
            layers=(LayerSpec("l", parts),),
        )

    def chain(self, node: int) -> list[int]:
        """The blocks from the root to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent[node]
        return path[::-1]

    def rows(self, blocks: list[int]) -> dict[str, np.ndarray]:
        """The k and v rows of ``blocks``."""
        ids = np.array(blocks)[:, None] * 7 + np.arange(self.row)[None, :]
        fill = ids.astype(np.uint8)
        return {"l.k": fill, "l.v": fill ^ 0xA5}


def key(block: int) -> bytes:
    """Block ``block``'s 16-byte store key."""
    return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16).digest()
