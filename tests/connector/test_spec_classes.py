"""Every KV cache spec class, served or refused by name (docs/vllm.md §4).

The table in docs/vllm.md and ``connector/spec_classes.py`` agree row for
row. Then the walk: for each served class, a worker saves blocks of a group of
that class into a real store and another worker loads them into other
blocks, bit for bit; for each refused class, both halves of the connector
start without raising, off, with one error line that names the class and
says why. Stand-ins carry the class's name and the fields the connector
reads (the name is what decides, as in vLLM 0.23, 0.32, 0.33 and
vllm-ascend 0.23.0.post1).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.spec_classes import SPEC_CLASSES
from npukv_store.connector.vllm_api import HANDS_OFF_BOUNDARY_STATES, VLLM_VERSION
from npukv_store.connector.worker.side import WorkerSide
from tests.support.ascend import NOPE, ROPE, ascend_mla
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    PAGE,
    cpu_caches,
    engine_config,
    settings,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
SERVED = sorted(name for name, rule in SPEC_CLASSES.items() if rule.kind)
REFUSED = sorted(name for name, rule in SPEC_CLASSES.items() if not rule.kind)
KEYS = [bytes([90 + i]) * 16 for i in range(3)]


def doc_rows() -> dict[str, tuple[str, str]]:
    """docs/vllm.md §4: class -> (its vLLM column, the first word served as)."""
    section = DOC.read_text().split("## 4. KV cache spec classes", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = (cells[1], cells[2].split(",")[0])
    return rows


def test_the_docs_table_is_the_connector_s():
    rows = doc_rows()
    assert set(rows) == set(SPEC_CLASSES), set(rows) ^ set(SPEC_CLASSES)
    for name, rule in SPEC_CLASSES.items():
        versions = "vllm-ascend" if rule.versions == "ascend" else rule.versions
        assert rows[name] == (versions, rule.kind or "refused"), name


def stand_in(class_name: str, **fields):
    """A spec of class ``class_name`` laid out as vLLM's CPU layout (tests/
    support/connector.py): what the connector reads of it."""
    cls = type(class_name, (SimpleNamespace,), {})
    common = dict(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
        dtype=torch.float32, page_size_bytes=PAGE,
    )  # fmt: skip
    kind = SPEC_CLASSES.get(class_name, SPEC_CLASSES["MambaSpec"]).kind
    if kind == "sliding":
        common["sliding_window"] = 2 * BLOCK
    if kind == "state":  # one fp32 state of a page's bytes per block, align mode
        common.update(
            shapes=((PAGE // 4,),), dtypes=(torch.float32,),
            real_page_size_bytes=PAGE, mamba_cache_mode="align",
        )  # fmt: skip
    return cls(**{**common, **fields})


def mla_caches(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """vllm-ascend's MLA value: (nope, rope), each [NB, bs, 1, dim] bf16."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: tuple(
            torch.randn(NUM_BLOCKS, BLOCK, 1, dim, generator=gen).to(torch.bfloat16)
            for dim in (NOPE, ROPE)
        )
        for name in LAYERS
    }


def block_bytes(value, block: int) -> bytes:
    parts = value if isinstance(value, tuple) else (value,)
    return b"".join(
        p[block].contiguous().view(torch.uint8).numpy().tobytes() for p in parts
    )


def served_case(class_name: str):
    """(engine config, caches maker) for a group of ``class_name``."""
    if class_name == "AscendMLAAttentionSpec":
        group = SimpleNamespace(layer_names=LAYERS, kv_cache_spec=ascend_mla())
        return engine_config(mla=True, groups=[group]), mla_caches
    mla = "MLA" in class_name
    group = SimpleNamespace(layer_names=LAYERS, kv_cache_spec=stand_in(class_name))
    return engine_config(mla=mla, groups=[group]), cpu_caches


def registered(tmp_path, config, caches) -> WorkerSide:
    worker = WorkerSide(*config, settings(tmp_path, layerwise="off"))
    worker.register(caches)
    assert worker.disabled_reason == "", worker.disabled_reason
    return worker


@pytest.mark.parametrize("class_name", SERVED)
def test_each_served_class_saves_and_loads_bit_for_bit(tmp_path, class_name):
    if SPEC_CLASSES[class_name].kind == "state" and not HANDS_OFF_BOUNDARY_STATES:
        pytest.skip(
            f"vLLM {VLLM_VERSION} hands no Mamba state blocks to a connector: "
            "refused there (tests/connector/test_state_groups.py checks it)"
        )
    config, caches = served_case(class_name)
    scheduler = SchedulerSide(*config, settings(tmp_path))
    assert scheduler.disabled_reason == ""
    assert scheduler.engine is not None
    assert [g.kind for g in scheduler.engine.groups] == [SPEC_CLASSES[class_name].kind]
    source, target = caches(1), caches(2)
    saver = registered(tmp_path, config, source)
    saver.bind(NPUKVMetadata(saves=[BlockTransfer("r", [3, 9, 5], [b"".join(KEYS)])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    loader = registered(tmp_path, config, target)
    loader.bind(
        NPUKVMetadata(loads=[BlockTransfer("r", [20, 21, 22], [b"".join(KEYS)])])
    )
    loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == set()
    for name in LAYERS:
        for new, old in zip([20, 21, 22], [3, 9, 5], strict=True):
            assert block_bytes(target[name], new) == block_bytes(source[name], old)
    loader.close()


def assert_off_with_one_line(tmp_path, caplog, config, *needles: str) -> None:
    """Both halves start, off, with ``needles`` in their reasons, and the
    engine's log has one error line with them (the scheduler's: a worker
    refused for the same setup leaves the saying to it)."""
    caplog.set_level(logging.ERROR)
    scheduler = SchedulerSide(*config, settings(tmp_path))
    worker = WorkerSide(*config, settings(tmp_path))
    worker.register(cpu_caches(3))
    for side in (scheduler, worker):
        for needle in needles:
            assert needle in side.disabled_reason, (needle, side.disabled_reason)
        assert "\n" not in side.disabled_reason
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    named = [line for line in lines if all(n in line for n in needles)]
    assert len(named) == 1, lines
    assert not any(r.exc_info for r in caplog.records)  # no traceback
    assert scheduler.engine is None  # off: nothing matched, nothing saved
    assert worker.stores == []


@pytest.mark.parametrize("class_name", REFUSED)
def test_each_refused_class_turns_the_connector_off_with_one_line(
    tmp_path, caplog, class_name
):
    group = SimpleNamespace(layer_names=LAYERS, kv_cache_spec=stand_in(class_name))
    assert_off_with_one_line(
        tmp_path, caplog, engine_config(groups=[group]),
        f"KV cache group 0 is {class_name}", SPEC_CLASSES[class_name].why,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("class_name", "fields", "found"),
    [
        ("FullAttentionSpec", {"non_causal": True}, "non_causal=True"),
        ("SlidingWindowMLASpec", {"bounded_replay": True}, "bounded_replay=True"),
        ("SinkFullAttentionSpec", {"prefix_cacheable": False}, "cacheable=False"),
        ("MLAAttentionSpec", {"tokens_per_state": 4}, "tokens_per_state=4"),
        ("MambaSpec", {"mamba_cache_mode": "none"}, "mamba_cache_mode='none'"),
        ("MambaSpec", {"num_speculative_blocks": 1}, "num_speculative_blocks=1"),
    ],
)  # fmt: skip
def test_a_served_class_in_another_form_is_refused_naming_the_field(
    tmp_path, caplog, class_name, fields, found
):
    spec = stand_in(class_name, **fields)
    group = SimpleNamespace(layer_names=LAYERS, kv_cache_spec=spec)
    assert_off_with_one_line(
        tmp_path, caplog, engine_config(groups=[group]),
        f"KV cache group 0 is {class_name}", found,
    )  # fmt: skip


def test_every_layer_of_a_per_layer_group_is_classified(tmp_path, caplog):
    """A UniformTypeKVCacheSpecs group is classified layer by layer, not by
    its first layer: a refused class among served ones turns it off."""
    wrapper = type("UniformTypeKVCacheSpecs", (SimpleNamespace,), {})
    specs = {
        LAYERS[0]: stand_in("FullAttentionSpec"),
        LAYERS[1]: stand_in("RSWASpec"),
        LAYERS[2]: stand_in("FullAttentionSpec"),
    }
    group = SimpleNamespace(
        layer_names=LAYERS, kv_cache_spec=wrapper(kv_cache_specs=specs)
    )
    assert_off_with_one_line(
        tmp_path, caplog, engine_config(groups=[group]),
        f"holds RSWASpec (layer {LAYERS[1]}) beside FullAttentionSpec",
        SPEC_CLASSES["RSWASpec"].why,
    )  # fmt: skip
