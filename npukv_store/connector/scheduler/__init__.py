"""The connector's scheduler side (EngineCore process): which blocks a request
loads, and which it saves (side.py: SchedulerSide, the hooks vLLM calls; keys.py:
the key chains; save_plan.py: a step's saves; load_policy.py: load or
recompute; remote_lookup.py: the remote tier's part of a hit). Never imports
connector.worker."""
