"""What tests and benchmarks share: real vLLM runs and servers, a connector
that keeps KV in memory, tiny models of several families, a Mooncake master,
and the children they start (each also a ``python -m bench.harness.NAME`` CLI
where it says so)."""
