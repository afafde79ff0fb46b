"""The tiny random models the e2e tests run (bench/harness/tiny_models.py) must be
able to show wrong KV: their greedy output depends on the context, not only
on the last tokens (small random Gemma weights, for one, just repeat the
input). Checked with Hugging Face transformers, without vLLM."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="building the models needs transformers")

from bench.harness import tiny_models  # noqa: E402

pytestmark = pytest.mark.integration


def greedy(model, prompt: list[int], steps: int = 6) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_greedy_output_depends_on_the_context(tmp_path, family):
    from transformers import AutoModelForCausalLM

    facts = tiny_models.build(family, str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(facts["model"]).float().eval()
    rng = random.Random(5)
    common = [rng.randrange(4, 2999) for _ in range(10)]
    outputs = []
    for _ in range(3):  # three prompts that differ only before the last 10
        prompt = [rng.randrange(4, 2999) for _ in range(60)] + common
        out = greedy(model, prompt)
        assert len(set(out)) > 1, f"{family}: repeats one token {out}"
        assert not _copies(prompt, out), f"{family}: copies its prompt {out}"
        outputs.append(out)
    assert len({tuple(out) for out in outputs}) == 3, f"{family}: {outputs}"


def _copies(prompt: list[int], out: list[int]) -> bool:
    """Whether ``out`` is a stretch of ``prompt``."""
    n = len(out)
    return any(prompt[i : i + n] == out for i in range(len(prompt) - n + 1))
