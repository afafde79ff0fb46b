"""The I/O layer: engines that submit batches of reads and writes and reap their
completions (engine.py: the API and make_engine; threads.py; uring.py)."""
