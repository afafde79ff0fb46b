# Sourced by scripts/test.sh (after scripts/setup_env.sh): the vLLM 0.33 lane's
# venv, .venv-vllm033, for the connector's unit tests only (no engine runs:
# vLLM 0.33 has no CPU build). Idempotent. Leaves PY033 pointing at the venv's
# python.
#
# An overlay on .venv, not a venv of its own: PyPI's vllm 0.33.0 wheel (CUDA;
# pins torch==2.14.0) goes in with --no-deps, and a .pth file then adds
# .venv's site-packages behind it (site.addsitedir, so that .venv's own .pth
# files, the editable npukv_store among them, apply too). `import vllm` finds
# 0.33 first; torch 2.13 (CPU), pytest and vLLM's other requirements come from
# .venv, as 0.32 pins them, which is what importing vLLM's connector API, KV
# cache specs and metrics needs. 30 s instead of the 3.5 min of a venv filled
# from PyPI.
PY033=.venv-vllm033/bin/python
source scripts/vllm_overlay.sh
vllm_overlay .venv-vllm033 vllm 0.33.0
unset -f vllm_overlay
