"""The connector's worker side (one vLLM Worker process per TP rank): device
copies between the KV pages and the store (side.py: WorkerSide, the hooks vLLM
calls; loads.py and loader.py: loads; save_step.py: saves; pages.py and
block_runs.py: KV pages as byte runs). Never imports connector.scheduler."""
