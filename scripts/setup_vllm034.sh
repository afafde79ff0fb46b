# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.34 lane's
# venv, .venv-vllm034, for the connector's unit tests only (no engine runs:
# vLLM 0.34 has no CPU build). Idempotent. Leaves PY034 pointing at the venv's
# python.
#
# An overlay on .venv, not a venv of its own: PyPI's vllm 0.34.0 wheel (CUDA;
# pins torch==2.14.0) goes in with --no-deps, and a .pth file then adds
# .venv's site-packages behind it (site.addsitedir, so that .venv's own .pth
# files, the editable npukv_store among them, apply too). `import vllm` finds
# 0.34 first; torch 2.13 (CPU), pytest and vLLM's other requirements come from
# .venv, as 0.32 pins them, which is what importing vLLM's connector API, KV
# cache specs, scheduler and metrics needs. 0.34's Requires-Dist asks more of
# a few (huggingface_hub>=2.0, filelock>=4.2.4, pillow>=13: .venv's meet
# them), and for orjson (the OpenAI server's) and CUDA kernels (flashinfer,
# tilelang, cutlass-dsl, ...), which no import here reaches. 30 s instead of
# the 3.5 min of a venv filled from PyPI.
PY034=.venv-vllm034/bin/python
source scripts/vllm_overlay.sh
vllm_overlay .venv-vllm034 vllm 0.34.0
unset -f vllm_overlay
