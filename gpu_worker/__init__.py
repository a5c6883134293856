"""GPU worker: one process per TP rank holding a model shard, its KV cache and its LoRA slot pool."""
