"""Code for tests that ships in the package because it must run inside any
process the tests start (a vLLM worker included): the fault injector
(faults.py)."""
