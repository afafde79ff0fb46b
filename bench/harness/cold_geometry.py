"""The model, prompts and each row's harness arguments of bench/cold_hit.py.

    Shape                  the model and its KV geometry: REFERENCE (issue
                           41's: 8 layers, hidden 512, 8 heads of 64, fp32,
                           block 64) or QUICK (``bench vllm --quick``'s: 4
                           layers, hidden 256, 4 heads of 64, block 32)
    ColdGeometry           one token count: prompt files, row arguments
    cold_geometry(...)     the model built once per work directory (its
                           positions fit the longest prompt), the files written

Per token count N (a directory ``tN`` in the work directory) and timed
prompt P (N random tokens): ``prompts.json`` (each P once), ``twice.json``
(each P twice: the second a hit in what the first filled), ``halves.json``
(each P's first half, whole blocks: what the partial hit's store holds),
``partial.json`` (a warm-up pair of the partial hit's shape, then each P)
and ``floor_partial.json`` (the warm-up pair, then each P's half and P: the
second of each pair a hit on the half in vLLM's prefix cache).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.vllm_run import WARMUP_TOKENS, ensure_model


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    block: int
    dtype: str = "float32"

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token: K and V of every layer."""
        head_dim = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head_dim * 4  # fp32

    def model_args(self, max_positions: int) -> list[str]:
        return [
            "--layers", str(self.layers), "--hidden", str(self.hidden),
            "--heads", str(self.heads), "--kv-heads", str(self.kv_heads),
            "--max-positions", str(max_positions),
        ]  # fmt: skip


#: issue 41's reference geometry (vLLM CPU 0.32: fp32 KV, block 64)
REFERENCE = Shape(layers=8, hidden=512, heads=8, kv_heads=8, block=64)
#: ``bench vllm --quick``'s geometry
QUICK = Shape(layers=4, hidden=256, heads=4, kv_heads=4, block=32)


@dataclass
class ColdGeometry:
    """One token count's prompts and each row's harness arguments."""

    work: Path  # this token count's directory
    model: Path
    shape: Shape
    tokens: int
    num_prompts: int
    prompts: list[list[int]] = field(default_factory=list)

    @property
    def block(self) -> int:
        return self.shape.block

    @property
    def half(self) -> int:
        """Tokens of a prompt a partial hit finds: its first half, whole blocks."""
        return self.tokens // 2 // self.block * self.block

    @property
    def stored_tokens_per_prompt(self) -> int:
        """Tokens a full hit loads: whole blocks, never the last token's."""
        return (self.tokens - 1) // self.block * self.block

    @property
    def warmup_tokens(self) -> int:
        """The harness's warm-up prompt, sent twice: whole blocks, then as many
        tokens as a full hit computes (the second send runs the full hit's
        load path and forward shape before the clock starts)."""
        tail = self.tokens - self.stored_tokens_per_prompt
        return max(WARMUP_TOKENS // self.block, 1) * self.block + tail

    def _common(self, prompts: str) -> list[str]:
        return [
            "--model", str(self.model), "--max-model-len", str(self.tokens + 128),
            "--block-size", str(self.block), "--dtype", self.shape.dtype,
            "--warmup-tokens", str(self.warmup_tokens), "--warmup-repeat", "2",
            "--prompts", str(self.work / prompts), "--max-tokens", "1",
        ]  # fmt: skip

    def floor(self, partial: bool = False) -> list[str]:
        """vLLM's own prefix cache, no connector: the second of each pair."""
        prompts = "floor_partial.json" if partial else "twice.json"
        return [*self._common(prompts), "--prefix-caching"]

    def memory(self) -> list[str]:
        return [*self._common("twice.json"), "--no-prefix-caching",
                "--connector", "memory"]  # fmt: skip

    def ours(self, cache: str, prompts: str) -> list[str]:
        """Our connector on ``cache``, vLLM's prefix cache off (every hit is
        the store's); the staging ring holds two steps of the longest prompt."""
        two_steps = 2 * (self.tokens + 128) * self.shape.bytes_per_token
        ring = max(256, (two_steps + (1 << 20) - 1) >> 20)  # MiB
        config = {
            "cache_dir": str(self.work / cache), "ring_size": f"{ring}MiB",
            "load_without_prefix_caching": True,
        }  # fmt: skip
        return [*self._common(prompts), "--no-prefix-caching",
                "--connector", "npukv", "--extra", json.dumps(config)]  # fmt: skip

    def example(self, prompts: str = "prompts.json") -> list[str]:
        extra = json.dumps({"shared_storage_path": str(self.work / "example")})
        return [*self._common(prompts), "--no-prefix-caching",
                "--connector", "example", "--extra", extra]  # fmt: skip

    def timed(self, windows: int, pairs: bool) -> list[int]:
        """The timed prompts' generate() windows among ``windows``: the last
        num_prompts, or the second of each of the last num_prompts pairs."""
        n = self.num_prompts
        if pairs:
            return list(range(windows - 2 * n + 1, windows, 2))
        return list(range(windows - n, windows))


def cold_geometry(
    work: Path, shape: Shape, tokens: list[int], num_prompts: int
) -> list[ColdGeometry]:
    """Each token count's geometry in ``work``: the model (built once, its
    positions fit the longest prompt) and the prompt files written."""
    work.mkdir(parents=True, exist_ok=True)
    positions = max(4096, max(tokens) + 256)
    model = work / f"model_{shape.layers}x{shape.hidden}_{positions}"
    ensure_model(model, shape.model_args(positions))
    found = []
    for count in tokens:
        directory = work / f"t{count}"
        directory.mkdir(exist_ok=True)
        geo = ColdGeometry(directory, model, shape, count, num_prompts)
        rng = random.Random(count)

        def draw(n: int) -> list[int]:
            return [rng.randrange(3, 2048) for _ in range(n)]  # noqa: B023

        geo.prompts = [draw(count) for _ in range(num_prompts)]
        halves = [p[: geo.half] for p in geo.prompts]
        warm_half = draw(geo.half)
        warm_pair = [warm_half, warm_half + draw(count - geo.half)]
        files = {
            "prompts.json": geo.prompts,
            "twice.json": [p for p in geo.prompts for _ in "ab"],
            "halves.json": halves,
            "partial.json": [*warm_pair, *geo.prompts],
            "floor_partial.json": [
                *warm_pair,
                *(x for h, p in zip(halves, geo.prompts, strict=True) for x in (h, p)),
            ],
        }
        for name, prompts in files.items():
            (directory / name).write_text(json.dumps(prompts))
        found.append(geo)
    return found
