"""What the cold hit's tracer wraps (bench/harness/trace.py's install()):
(label, owner "module:Class" or "module", attribute) per target.

    VLLM       vLLM's steps: generate, add_request, the engine step, the
               scheduler, the KV cache manager, the model runner, outputs
    HOOKS      every connector hook, wrapped on each of CONNECTORS
    OURS       our scheduler and worker internals, store, reader, routes
    EXAMPLE    ExampleConnector's load and the memory connector's copy
    OS_CALLS   os.open / posix_fadvise / os.path.exists / os.makedirs

bench/harness/cold_stages.py groups these labels into the stages of a hit.
"""

from __future__ import annotations

#: (label, owner "module:Class" or "module", attribute): what install() wraps.
#: A target that does not exist (another vLLM, a refactored store) is skipped
#: and listed in the trace's "missing".
VLLM = [
    ("generate", "vllm.entrypoints.llm:LLM", "generate"),
    ("llm.add_request", "vllm.v1.engine.llm_engine:LLMEngine", "add_request"),
    ("llm.step", "vllm.v1.engine.llm_engine:LLMEngine", "step"),
    ("engine.step", "vllm.v1.engine.core:EngineCore", "step"),
    ("engine.post_step", "vllm.v1.engine.core:EngineCore", "post_step"),
    ("sched.schedule", "vllm.v1.core.sched.scheduler:Scheduler", "schedule"),
    (
        "sched.update_from_output",
        "vllm.v1.core.sched.scheduler:Scheduler",
        "update_from_output",
    ),
    (
        "kvm.get_computed_blocks",
        "vllm.v1.core.kv_cache_manager:KVCacheManager",
        "get_computed_blocks",
    ),
    (
        "kvm.allocate_slots",
        "vllm.v1.core.kv_cache_manager:KVCacheManager",
        "allocate_slots",
    ),
    (
        "executor.execute_model",
        "vllm.v1.executor.uniproc_executor:UniProcExecutor",
        "execute_model",
    ),
    (
        "runner.execute_model",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "execute_model",
    ),
    (
        "runner._update_states",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_update_states",
    ),
    (
        "runner._zero_block_ids",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_zero_block_ids",
    ),
    (
        "runner._prepare_inputs",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_prepare_inputs",
    ),
    (
        "runner._build_attention_metadata",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_build_attention_metadata",
    ),
    (
        "runner._model_forward",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "_model_forward",
    ),
    (
        "runner.sample_tokens",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "sample_tokens",
    ),
    (
        "output.process_outputs",
        "vllm.v1.engine.output_processor:OutputProcessor",
        "process_outputs",
    ),
]
HOOKS = [
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
    "build_connector_worker_meta",
    "update_connector_output",
    "get_kv_connector_stats",
    "request_finished",
    "request_finished_all_groups",
]
CONNECTORS = [
    "npukv_store.connector.connector:NPUKVStoreConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
    "bench.harness.memory_connector:MemoryConnector",
]
OURS = [
    ("ours.match", "npukv_store.connector.scheduler.side:SchedulerSide", "match"),
    ("ours.keys", "npukv_store.connector.scheduler.side:SchedulerSide", "_keys"),
    ("ours.hit", "npukv_store.connector.scheduler.side:SchedulerSide", "_hit"),
    ("ours.decide", "npukv_store.connector.scheduler.side:SchedulerSide", "_decide"),
    (
        "ours.allocated",
        "npukv_store.connector.scheduler.side:SchedulerSide",
        "allocated",
    ),
    (
        "ours.build_meta",
        "npukv_store.connector.scheduler.side:SchedulerSide",
        "build_meta",
    ),
    ("store.lookup", "npukv_store.store.store:KVStore", "lookup"),
    ("store.present", "npukv_store.store.store:KVStore", "present"),
    ("store.readahead", "npukv_store.store.store:KVStore", "readahead"),
    ("store.read_many", "npukv_store.store.store:KVStore", "read_many"),
    ("index.lookup_prefix", "npukv_store.store.index:Index", "lookup_prefix"),
    ("index.locate", "npukv_store.store.index:Index", "locate"),
    ("worker.bind", "npukv_store.connector.worker.side:WorkerSide", "bind"),
    ("worker.start_load", "npukv_store.connector.worker.side:WorkerSide", "start_load"),
    (
        "worker.finish_step",
        "npukv_store.connector.worker.side:WorkerSide",
        "finish_step",
    ),
    ("loader.new_job", "npukv_store.connector.worker.loader:LayerLoader", "new_job"),
    ("loader.run", "npukv_store.connector.worker.loader:LayerLoader", "run"),
    (
        "loader.read_direct",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_read_direct",
    ),
    (
        "loader.load_layers",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_load_layers",
    ),
    (
        "loader.read_layer",
        "npukv_store.connector.worker.loader:LayerLoader",
        "_read_layer",
    ),
    (
        "loader.wait_layer",
        "npukv_store.connector.worker.loader:LayerLoader",
        "wait_layer",
    ),
    ("loader.settle", "npukv_store.connector.worker.loader:LayerLoader", "settle"),
    ("reader.read_chunks", "npukv_store.store.read.reader:ChunkReader", "read_chunks"),
    ("reader.read_rows", "npukv_store.store.read.reader:ChunkReader", "read_rows"),
    ("reader.header", "npukv_store.store.read.reader:ChunkReader", "_header"),
    ("headers.get", "npukv_store.store.read.headers:ChunkHeaders", "get"),
    ("headers.prefetch", "npukv_store.store.read.headers:ChunkHeaders", "prefetch"),
    ("parse_header", "npukv_store.store.read.headers", "parse_header"),
    (
        "reader.read_layers",
        "npukv_store.store.read.reader:ChunkReader",
        "_read_layers",
    ),
    ("reader.plan", "npukv_store.store.read.reader:ChunkReader", "_plan"),
    ("route.cached", "npukv_store.store.read.reader", "read_cached"),
    ("route.streamed", "npukv_store.store.read.reader", "read_streamed"),
    ("route.engine", "npukv_store.store.read.reader", "read_by_engine"),
    ("files.residency", "npukv_store.store.read.routes:ChunkFiles", "residency"),
    ("files.open_direct", "npukv_store.store.read.routes:ChunkFiles", "open_direct"),
    ("verify.check_layer", "npukv_store.store.read.routes:ChunkRead", "check_layer"),
    ("native.pread_layers_xxh3", "npukv_store.native", "pread_layers_xxh3"),
    ("engine.submit", "npukv_store.io.uring:UringEngine", "submit"),
    ("engine.reap", "npukv_store.io.uring:UringEngine", "reap"),
    ("reader.engine", "npukv_store.store.read.reader:ChunkReader", "_engine"),
    ("native.cached_pages", "npukv_store.native", "cached_pages"),
    ("native.layer_checksums", "npukv_store.store.read.routes", "layer_checksums"),
    ("device.copy_runs", "npukv_store.device.cpu:CpuBackend", "copy_runs"),
    ("device.host_view", "npukv_store.device.cpu:CpuBackend", "host_view"),
]
EXAMPLE = [
    (
        "example.found_match",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
        "_found_match_for_request",
    ),
    (
        "example.filename",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector",
        "_generate_filename_debug",
    ),
    ("safetensors.load_file", "safetensors.torch", "load_file"),
    ("memory.load", "bench.harness.memory_connector:MemoryConnector", "_load"),
]
OS_CALLS = [
    ("os.open", "os", "open"),
    ("os.posix_fadvise", "os", "posix_fadvise"),
    ("os.path.exists", "os.path", "exists"),
    ("os.makedirs", "os", "makedirs"),
]
