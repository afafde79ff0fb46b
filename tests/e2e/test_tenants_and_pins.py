"""Tenants and a pinned prompt on real vLLM (CPU build; docs/guide/
tenants-and-pins.md): the operator pins a system prompt with ``npukv pin``;
a server meets it as tenant team-a, then tenant team-b's prompts fill the
directory several times over; a restarted server loads the whole pinned
prompt from NVMe with the tokens of its first run, while team-b's first
prompt is long gone. ``npukv stats`` lists both tenants and the pin."""

from __future__ import annotations

import json
import random

import pytest

from bench.harness.runs import build_model, run
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import tiny_spec
from tests.support.cli import npukv

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
pytestmark = pytest.mark.e2e

BLOCK = 32  # the harness's block size for the tiny Llama


def test_a_pinned_prompt_survives_another_tenant_filling_the_directory(tmp_path):
    model = build_model(tmp_path / "model", "llama")
    cache = tmp_path / "cache"
    rng = random.Random(29)
    system = [rng.randrange(4, 2999) for _ in range(8 * BLOCK + 5)]
    others = [[rng.randrange(4, 2999) for _ in range(6 * BLOCK)] for _ in range(14)]
    # about 2.6 directories of team-b's prompts: a 4-layer model at 2 KiB/token
    # team-a has no share: only the pin keeps its prompt
    extra = {"capacity": "4MiB", "tenant_shares": {"team-b": 0.5}, "evict_grace_s": 0}
    with KVStore(StoreConfig(cache_dir=str(cache)), tiny_spec()) as store:
        team_a, team_b = store.tenant("team-a"), store.tenant("team-b")
    ids = tmp_path / "system.json"
    ids.write_text(json.dumps(system))
    pinned = npukv("pin", str(cache), "--token-ids-file", str(ids),
                    "--cache-salt", "team-a", "--label", "system")  # fmt: skip
    assert pinned.returncode == 0, pinned.stderr
    salts = ["team-a"] + ["team-b"] * len(others)
    first = run(
        tmp_path, "fill", [system, *others], model=model, cache_dir=cache,
        extra=extra, args=("--cache-salts", json.dumps(salts)),
    )  # fmt: skip
    assert "connector is off" not in first["log"]
    stats = npukv("stats", str(cache), "--json")
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    (pin,) = report["pins"]
    assert pin["label"] == "system"
    assert pin["pinned_keys"] >= 8  # 8 blocks, in each namespace of the model
    assert report["pinned_chunks"] >= 1
    tenants = report["tenants"]
    assert tenants[team_b.hex()]["bytes"] > 0
    assert tenants[team_b.hex()]["share_bytes"] == (4 << 20) // 2
    assert team_a.hex() in tenants, "team-a's pinned prompt was evicted"
    assert tenants[team_a.hex()]["share_bytes"] is None
    assert report["used_bytes"] <= 4 << 20
    second = run(
        tmp_path, "again", [system, others[0]], model=model, cache_dir=cache,
        extra=extra, args=("--cache-salts", json.dumps(["team-a", "team-b"])),
    )  # fmt: skip
    hit, evicted = second["results"]
    assert hit["external_tokens"] == 8 * BLOCK  # the whole pinned prompt
    assert hit["tokens"] == first["results"][0]["tokens"]
    assert evicted["external_tokens"] == 0  # team-b's first prompt went
