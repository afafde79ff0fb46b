"""The write path of the store: batches staged in the shared-memory ring and
published by the writer thread (staging.py), and the chunk file they become
(chunk_file.py). Never imports store.read."""
