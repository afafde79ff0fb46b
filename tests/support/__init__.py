"""Helpers that tests share: import them from here, never from another test.

blocks      - tiny_spec, block_tensors, empty_blocks, verify_read: namespaces
              and block contents that any process can check
chunks      - chunk files on disk, tmp/ leftovers, page-cache state
scenarios/  - the multi-process and SIGKILL scenarios (quick and stress forms)
faults      - the fault suite's stores, bit flips, mounts and children
connector   - vLLM's objects as the connector reads them, CPU KV caches
ascend      - vllm-ascend and Ascend NPU stand-ins
load_policy - a load policy that has measured, on a fake clock
remote      - the Mooncake tier tests' configs, nodes and expected values
served      - the served tests' output checks
startup_fault - the connector failing at start-up (tests/e2e/test_startup.py)
"""
