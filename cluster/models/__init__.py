"""flotilla.cluster.models: model definitions (Llama/Qwen/Mistral dense, Qwen3-MoE/Mixtral,
DeepSeek-V2/V3/V3.2, GLM-4.x, GLM-5) built from parallel-ready layers that shard themselves
by a ``ParallelLayout``; loading from safetensors, GGUF, block-FP8 checkpoints or dummy
weights. ``registry`` maps an architecture name to its class."""
