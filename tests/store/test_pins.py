"""Pinned prompts (docs/decisions/0067): what ``npukv pin`` records, how a
server applies it to its keys, and that pinned blocks outlive a directory
filled several times over by other processes until ``npukv unpin`` or the
expiry."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from npukv_store import KVStore, StoreConfig
from npukv_store.cli import main
from npukv_store.connector.scheduler.keys import KeyChains
from npukv_store.connector.scheduler.pins import PinApplier
from npukv_store.errors import FormatError
from npukv_store.store.pins import PIN_GRANULE, PinRecord, pin_digests
from tests.support.blocks import block_tensors, tiny_spec

KEY = b"k" * 32
tokens_lists = st.lists(st.integers(0, 2**31 - 1), max_size=120)


@given(tokens=tokens_lists, cut=st.integers(0, 120), salt=st.none() | st.text())
def test_a_prefix_has_the_leading_digests_of_the_whole(tokens, cut, salt):
    whole = pin_digests(KEY, salt, tokens)
    assert len(whole) == len(tokens) // PIN_GRANULE
    assert pin_digests(KEY, salt, tokens[:cut]) == whole[: cut // PIN_GRANULE]


@given(tokens=st.lists(st.integers(0, 1000), min_size=16, max_size=64))
def test_the_salt_and_the_key_change_every_digest(tokens):
    plain = pin_digests(KEY, None, tokens)
    assert pin_digests(KEY, "", tokens) == plain  # "" is no salt, as in vLLM
    salted = pin_digests(KEY, "tenant-a", tokens)
    other_key = pin_digests(b"o" * 32, None, tokens)
    assert not set(plain) & set(salted)
    assert not set(plain) & set(other_key)


@given(
    digests=st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=20),
    tenant=st.binary(min_size=8, max_size=8),
    label=st.text(max_size=30),
    expires=st.integers(0, 2**62),
)
def test_a_pin_record_round_trips(digests, tenant, label, expires):
    record = PinRecord(b"i" * 8, tuple(digests), tenant, label, 5, expires)
    assert PinRecord.from_json(b"i" * 8, record.to_json()) == record


@pytest.mark.parametrize(
    "raw",
    [b"", b"[]", b'{"digests": "zz", "tenant": "00"}',
     b'{"digests": "00", "tenant": "0000000000000000"}'],
)  # fmt: skip
def test_a_garbled_pin_record_is_one_format_error(raw):
    with pytest.raises(FormatError, match="pin 6969696969696969") as info:
        PinRecord.from_json(b"i" * 8, raw)
    assert "\n" not in str(info.value)


# -- a server applies pins to its own keys ------------------------------------------


def _config(root, capacity=1 << 30):
    return StoreConfig(cache_dir=str(root), capacity=capacity, evict_grace_s=0,
                       fsync="never")  # fmt: skip


def _request(tokens, salt=None):
    return SimpleNamespace(
        prompt_token_ids=list(tokens), all_token_ids=list(tokens),
        num_prompt_tokens=len(tokens), cache_salt=salt, lora_request=None,
        mm_features=None, prompt_embeds=None, request_id="r",
    )  # fmt: skip


def _chains(store: KVStore) -> KeyChains:
    fingerprint = store.fingerprint
    return KeyChains(
        store.spec.block_size, [[fingerprint]], [fingerprint],
        chain_key=store.key_domain.chain_key,
    )  # fmt: skip


def _pin(store: KVStore, tokens, salt=None, ttl_s=None, label="sys") -> PinRecord:
    digests = pin_digests(store.key_domain.pin_key, salt, tokens)
    record = PinRecord.new(digests, store.tenant(salt), label=label, ttl_s=ttl_s)
    store.index.add_pin(record.pin_id, record.to_json())
    return record


PROMPT = list(range(1000, 1000 + 80))  # 5 blocks of 16


def test_a_server_pins_the_blocks_a_request_shares_with_a_pinned_prompt(tmp_path):
    with KVStore(_config(tmp_path), tiny_spec()) as store:
        chains = _chains(store)
        pin = _pin(store, PROMPT)
        applier = PinApplier(store, chains)
        # another tenant's request with the same tokens: not this pin's
        assert applier.apply(chains.new_state(_request(PROMPT + [1], "x"))) == 0
        # 40 shared tokens: two whole granules, so two 16-token blocks
        partial = chains.new_state(_request(PROMPT[:40] + [7] * 60))
        assert applier.apply(partial) == 1
        assert store.index.pinned_keys(pin.pin_id) == 2
        full = chains.new_state(_request(PROMPT + [5] * 30))
        assert applier.apply(full) == 1
        assert applier.apply(chains.new_state(_request(PROMPT + [6]))) == 0  # done
        keys = chains.keys(full, 5)[0][0]
        assert store.index.pinned_key_set() == set(keys)
        # stored after the pin: its chunk is pinned at once
        store.put(keys, block_tensors(store.spec, keys))
        assert all(r.pinned for r in store.index.iter_chunks())
        assert store.check() == []


def test_an_expired_pin_is_removed_by_the_next_refresh(tmp_path):
    with KVStore(_config(tmp_path), tiny_spec()) as store:
        chains = _chains(store)
        pin = _pin(store, PROMPT, ttl_s=0.05)
        clock = [0.0]
        applier = PinApplier(store, chains, clock=lambda: clock[0])
        state = chains.new_state(_request(PROMPT))
        assert applier.apply(state) == 1
        time.sleep(0.1)
        clock[0] = 10.0  # past REFRESH_S
        applier.refresh()
        assert store.index.pin_records() == {}
        assert store.index.pinned_keys(pin.pin_id) == 0


# -- several processes: a server that pins, two that fill the directory ----------


def _serve_pinned_prompt(root: str, capacity: int, out) -> None:
    with KVStore(_config(root, capacity), tiny_spec()) as store:
        chains = _chains(store)
        applier = PinApplier(store, chains)
        deadline = time.monotonic() + 30
        state = chains.new_state(_request(PROMPT + [3] * 20))
        while not applier.apply(state) and time.monotonic() < deadline:
            time.sleep(0.2)  # the operator's pin arrives within REFRESH_S
            state = chains.new_state(_request(PROMPT + [3] * 20))
        keys = chains.keys(state, 5)[0][0]
        store.put(keys, block_tensors(store.spec, keys))
        out.put(b"".join(keys))


def _fill_with_other_prompts(root: str, capacity: int, chunks: int, out) -> None:
    spec = tiny_spec()
    with KVStore(_config(root, capacity), spec) as store:
        for _ in range(chunks):
            keys = [os.urandom(16) for _ in range(4)]
            store.put(keys, block_tensors(spec, keys))
    out.put(b"")


@pytest.mark.integration
def test_pinned_blocks_survive_other_processes_filling_the_directory(tmp_path, capsys):
    root = str(tmp_path / "cache")
    capacity = 30 * 4 * tiny_spec().block_bytes  # about 25 chunks of 4 blocks
    with KVStore(_config(root, capacity), tiny_spec()):
        pass  # the directory and its secret
    ids = tmp_path / "prompt.json"
    ids.write_text(json.dumps(PROMPT))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    server = ctx.Process(target=_serve_pinned_prompt, args=(root, capacity, out))
    server.start()
    assert main(["pin", root, "--token-ids-file", str(ids), "--label", "sys",
                 "--ttl", "1h"]) == 0  # fmt: skip
    pinned = out.get(timeout=120)
    fillers = [
        ctx.Process(target=_fill_with_other_prompts, args=(root, capacity, 90, out))
        for _ in range(2)
    ]  # each fills the directory three times over
    for worker in fillers:
        worker.start()
    for _ in fillers:
        out.get(timeout=300)
    for worker in [server, *fillers]:
        worker.join(60)
        assert worker.exitcode == 0
    keys = [pinned[i : i + 16] for i in range(0, len(pinned), 16)]
    with KVStore(_config(root, capacity), tiny_spec()) as store:
        assert store.lookup(keys) == 5
        assert store.check() == []
    capsys.readouterr()
    assert main(["stats", root, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (pin,) = report["pins"]
    assert (pin["label"], pin["tokens"], pin["pinned_keys"]) == ("sys", 80, 5)
    assert report["pinned_chunks"] == 1
    assert pin["expires_ns"] > time.time_ns()
    assert main(["stats", root]) == 0
    text = capsys.readouterr().out
    assert pin["pin"] in text
    assert "sys" in text
    # unpinned: the next fill evicts them
    assert main(["unpin", root, "--label", "sys"]) == 0
    assert f"unpinned {pin['pin']}" in capsys.readouterr().out
    _fill_with_other_prompts(root, capacity, 40, out)
    with KVStore(_config(root, capacity), tiny_spec()) as store:
        assert store.lookup(keys) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ttl", "soon"], "--ttl: found 'soon', expected a duration"),
        ([], "expected --token-ids-file F, or --prompt-file F with --model M"),
        (["--token-ids-file", "BAD"], "expected a JSON list of token ids"),
        (["--token-ids-file", "SHORT"], "the prompt has 3 tokens, expected 16"),
    ],
)
def test_npukv_pin_refuses_bad_input_with_one_line(tmp_path, capsys, argv, message):
    root = str(tmp_path / "cache")
    with KVStore(_config(root), tiny_spec()):
        pass
    (tmp_path / "bad.json").write_text('{"a": 1}')
    (tmp_path / "short.json").write_text("[1, 2, 3]")
    (tmp_path / "ok.json").write_text(json.dumps(PROMPT))
    files = {"BAD": "bad.json", "SHORT": "short.json"}
    argv = [str(tmp_path / files[a]) if a in files else a for a in argv]
    if argv and argv[0] == "--ttl":
        argv += ["--token-ids-file", str(tmp_path / "ok.json")]
    assert main(["pin", root, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1
    assert main(["unpin", root, "0123456789abcdef"]) == 2
    assert "no pin 0123456789abcdef" in capsys.readouterr().err


def test_the_maintenance_job_removes_expired_pins_and_keeps_the_others(tmp_path):
    from npukv_store import maintenance

    root = str(tmp_path / "cache")
    with KVStore(_config(root), tiny_spec()) as store:
        chains = _chains(store)
        expiring = _pin(store, PROMPT, ttl_s=0.01, label="old")
        lasting = _pin(store, PROMPT[16:], label="new")
        # a server applied the expiring pin to stored blocks before it expired
        state = chains.new_state(_request(PROMPT))
        assert store.index.pin_keys(expiring.pin_id, chains.keys(state, 5)[0][0]) == 0
        keys = chains.keys(state, 5)[0][0]
        store.put(keys, block_tensors(store.spec, keys))
        assert all(r.pinned for r in store.index.iter_chunks())
    time.sleep(0.05)
    summary = maintenance.run(maintenance.Options(cache_dir=root, compact=False))
    assert summary.pins_expired == 1
    with KVStore(_config(root), tiny_spec()) as store:
        assert set(store.index.pin_records()) == {lasting.pin_id}
        assert not any(r.pinned for r in store.index.iter_chunks())
        assert store.check() == []


def _word_tokenizer(path) -> None:
    """A WordLevel tokenizer (``w<i>`` is token i), as the harness's models have."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(100)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(
        path
    )


def test_npukv_pin_tokenizes_a_prompt_file_with_the_models_tokenizer(tmp_path, capsys):
    pytest.importorskip("transformers", reason="--prompt-file needs transformers")
    root = str(tmp_path / "cache")
    with KVStore(_config(root), tiny_spec()):
        pass
    _word_tokenizer(tmp_path / "model")
    ids = [5 + i for i in range(40)]
    (tmp_path / "prompt.txt").write_text(" ".join(f"w{i}" for i in ids))
    argv = [
        "pin", root, "--prompt-file", str(tmp_path / "prompt.txt"),
        "--model", str(tmp_path / "model"), "--cache-salt", "t", "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens"] == 32  # two whole 16-token pieces of 40
    with KVStore(_config(root), tiny_spec()) as store:
        ((pin_id, raw),) = store.index.pin_records().items()
        record = PinRecord.from_json(pin_id, raw)
        assert record.digests == tuple(pin_digests(store.key_domain.pin_key, "t", ids))
        assert record.tenant == store.tenant("t")
    assert main([*argv[:4], "--model", str(tmp_path / "none")]) == 2
    assert "cannot load its tokenizer" in capsys.readouterr().err
