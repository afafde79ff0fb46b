"""The vLLM connector: the only package of npukv_store that imports vllm.

Use it with ``kv_connector="NPUKVStoreConnector"`` and
``kv_connector_module_path="npukv_store.connector"``.
"""

from npukv_store.connector.connector import NPUKVStoreConnector

__all__ = ["NPUKVStoreConnector"]
