"""``npukv plan``: a model's blocks, chunks, index, ring and host memory from
its config.json, from the same code the connector sizes with (a worker's auto
ring for a model is the plan's), MLA against GQA, and one line for bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.cli import main
from npukv_store.store.model_shape import ModelShape
from npukv_store.store.sizing import REFERENCE_MODELS, plan

TB = 10**12


def _plan_json(capsys, path, *args) -> dict:
    assert main(["plan", str(path), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def deepseek(tmp_path):
    path = tmp_path / "deepseek" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(REFERENCE_MODELS["deepseek-v3"]))
    return path


@pytest.fixture
def qwen3(tmp_path):
    path = tmp_path / "qwen3.json"
    path.write_text(json.dumps(REFERENCE_MODELS["qwen3-235b-a22b"]))
    return path


def test_mla_is_one_namespace_whatever_the_tp(capsys, deepseek):
    args = ["--capacity", "14TB", "--max-num-batched-tokens", "16384"]
    tp16 = _plan_json(capsys, deepseek.parent, "--tp", "16", *args)  # the dir form
    tp4 = _plan_json(capsys, deepseek, "--tp", "4", *args)
    assert tp16["attention"] == "MLA"
    assert tp16["namespaces"] == tp4["namespaces"] == 1
    assert tp16["block_bytes"] == 61 * (512 + 64) * 2 * 128
    assert tp16["blocks"] == tp4["blocks"]  # stored once: TP changes nothing
    assert tp16["shm_bytes_per_node"] == 16 * tp16["ring_bytes_per_worker"]
    # a 16384-token step of 70,272 B per token, twice, headers included
    assert 2 * 16384 * 70272 <= tp16["ring_bytes_per_worker"] <= 2.01 * 16384 * 70272
    assert tp16["processes"] == 17


def test_gqa_is_a_namespace_per_rank_with_replicated_heads(capsys, qwen3):
    tp4 = _plan_json(capsys, qwen3, "--tp", "4", "--capacity", "14TB")
    tp16 = _plan_json(capsys, qwen3, "--tp", "16", "--capacity", "14TB")
    assert (tp4["namespaces"], tp16["namespaces"]) == (4, 16)
    assert not tp4["replicated_heads"]
    assert tp16["replicated_heads"]  # 4 KV heads over 16 ranks
    assert tp4["block_bytes"] == tp16["block_bytes"] == 94 * 2 * 128 * 2 * 128
    assert tp16["stored_bytes_per_token"] == 4 * tp4["stored_bytes_per_token"]
    assert tp16["tokens_cached"] * 4 == pytest.approx(tp4["tokens_cached"], rel=1e-3)


def test_text_form_names_each_section(capsys, qwen3):
    assert main(["plan", str(qwen3), "--tp", "4"]) == 0
    out = capsys.readouterr().out
    labels = ("namespaces", "blocks (index keys)", "index_map_size",
              "rings per node", "prompts of 32,768 tokens")  # fmt: skip
    for label in labels:
        assert label in out, out


def test_a_worker_makes_the_ring_the_plan_prints(tmp_path):
    """The tiny model of the connector's tests: vLLM's page sizes against the
    plan's layout from a config.json of the same shape."""
    pytest.importorskip("vllm", reason="the connector needs vLLM")
    from npukv_store import StoreConfig
    from npukv_store.connector.worker.side import WorkerSide
    from tests.support.connector import BLOCK, HEAD_DIM, HEADS, LAYERS, engine_config

    worker = WorkerSide(*engine_config(), StoreConfig(cache_dir=str(tmp_path / "c")))
    config = {"num_hidden_layers": len(LAYERS), "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
              "torch_dtype": "float32"}  # fmt: skip
    planned = plan(ModelShape.from_hf_config(config), tp=1, block_size=BLOCK,
                   capacity=TB)  # fmt: skip
    assert worker.specs[0].block_bytes == planned.block_bytes
    assert worker._ring_request.wanted == planned.ring_bytes_per_worker


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(1 << 30, 1 << 50),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    model=st.sampled_from(sorted(REFERENCE_MODELS)),
    block_size=st.sampled_from([16, 64, 128]),
)
def test_the_plan_fills_the_capacity_and_no_more(capacity, tp, model, block_size):
    shape = ModelShape.from_hf_config(REFERENCE_MODELS[model])
    p = plan(shape, tp=tp, block_size=block_size, capacity=capacity)
    ns = p.namespaces
    assert p.chunks * p.chunk_bytes <= capacity
    assert (p.chunks + ns) * p.chunk_bytes > capacity - ns
    assert p.blocks == p.chunks * p.blocks_per_chunk
    assert p.tokens_cached == p.blocks // ns * block_size
    assert p.chunks_one_block >= p.chunks
    assert p.index_bytes_one_block >= p.index_bytes_in_use


BAD = {
    "missing": (None, "no such file"),
    "not json": ("{nope", "not JSON"),
    "a list": ("[1, 2]", "JSON list"),
    "no layers": (json.dumps({"torch_dtype": "bfloat16"}), "num_hidden_layers missing"),
    "bad heads": (json.dumps({"num_hidden_layers": 2, "num_attention_heads": "8",
                              "hidden_size": 64, "torch_dtype": "bfloat16"}),
                  "num_attention_heads is '8'"),
    "bad dtype": (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8,
                              "hidden_size": 64, "torch_dtype": "int3"}), "int3"),
    "mamba": (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8,
                          "hidden_size": 64, "torch_dtype": "bfloat16",
                          "layer_types": ["full_attention", "linear_attention"]}),
              "linear_attention"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    body, expected = BAD[case]
    path = tmp_path / "config.json"
    if body is not None:
        path.write_text(body)
    assert main(["plan", str(path), "--tp", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("npukv plan: "), lines
    assert expected in lines[0], lines
    assert captured.out == ""


def test_bad_numbers_are_one_line(tmp_path, capsys, qwen3):
    assert main(["plan", str(qwen3), "--tp", "0"]) == 2
    assert "--tp: found 0, expected >= 1" in capsys.readouterr().err
    assert main(["plan", str(qwen3), "--capacity", "lots"]) == 2
    assert "--capacity" in capsys.readouterr().err
