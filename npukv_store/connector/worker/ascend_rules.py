"""What vllm-ascend does that the worker must know before it happens.

Runs in: every vLLM Worker process (WorkerSide, on the forward thread at
register_kv_caches and start_load_kv). Pure functions of configuration and
metadata: no vLLM, torch or device import.

    SkippedWaits        - whether a step's MLA attention may call no
                          wait_for_layer_load, so its loads must be fenced in
                          start_load_kv
    kernel_block_rows() - rows of a registered tensor's dim 0 per vLLM block

Read in vllm-ascend 0.23.0.post1 (docs/device.md §2 and §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vllm-ascend's attention kernels' block size (get_supported_kernel_block_sizes
#: of attention_v1.py:143-144 and mla_v1.py:117-118)
ASCEND_KERNEL_BLOCK = 128


@dataclass(frozen=True, slots=True)
class SkippedWaits:
    """vllm-ascend's MLA attention calls ``wait_for_layer_load`` only when its
    step has a prefill (mla_v1.py:1653-1654), and it counts every request of
    at most ``decode_threshold`` tokens (1, or 1 + num_speculative_tokens;
    mla_v1.py:264-267) as a decode, prefilling or not
    (``treat_short_extends_as_decodes``, attention/utils.py:386-390). A
    full-prefix hit leaves one token to compute: the step that loads it may
    call no wait hook at all. GQA attention waits in vLLM's decorator every
    step, so that part of the rule is MLA's on an NPU only.

    Decode graphs: vLLM turns full graph modes into PIECEWISE for this
    connector, but vllm-ascend's xlite sets FULL_DECODE_ONLY afterwards
    (platform.py:515-525). A batch of decodes (each request 1 +
    num_speculative_tokens) then replays a full graph, which runs no hook:
    with such a mode every model's decode-sized steps may skip the waits."""

    mla: bool
    decode_threshold: int
    decode_graphs: bool = False

    @classmethod
    def from_config(cls, vllm_config: Any) -> SkippedWaits:
        model = getattr(vllm_config, "model_config", None)
        speculative = getattr(vllm_config, "speculative_config", None)
        drafts = int(getattr(speculative, "num_speculative_tokens", 0) or 0)
        compilation = getattr(vllm_config, "compilation_config", None)
        mode = getattr(getattr(compilation, "cudagraph_mode", None), "name", "")
        return cls(
            bool(getattr(model, "use_mla", False)),
            1 + drafts,
            mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"),
        )

    def may_skip(self, backend_kind: str, max_request_tokens: int) -> bool:
        """Whether the step's attention may skip every wait hook.

        True for MLA on an NPU (or under decode graphs) when no request
        computes more than the decode threshold, and when the scheduler did
        not say (0): a step predicted to skip that waits after all only loses
        overlap, while one predicted to wait that skips would have its loads
        recomputed. A request of more tokens than the threshold is always a
        prefill for vllm-ascend's MLA, and never in a decode graph, so the
        waits do run then.
        """
        return max_request_tokens <= self.decode_threshold and (
            (self.mla and backend_kind == "npu") or self.decode_graphs
        )


def kernel_block_rows(backend_kind: str, num_groups: int, block_size: int) -> int:
    """How many rows of a registered KV tensor's dim 0 hold one vLLM block.

    With more than one KV cache group vllm-ascend allocates every attention
    layer in kernel blocks of 128 tokens: dim 0 is ``num_blocks * block_size /
    128`` and vLLM block b is rows ``b*s .. b*s+s-1``
    (model_runner_v1.py:4561-4569). 1 everywhere else.
    """
    if (
        backend_kind == "npu"
        and num_groups > 1
        and block_size > ASCEND_KERNEL_BLOCK
        and block_size % ASCEND_KERNEL_BLOCK == 0
    ):
        return block_size // ASCEND_KERNEL_BLOCK
    return 1
