"""flotilla.cluster.engine: scheduler, KV block manager, sampler, model runner and the offline LLM."""
