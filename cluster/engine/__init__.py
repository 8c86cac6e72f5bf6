"""flotilla.cluster.engine: one engine. ``scheduler``/``block_manager``/``schedule_policy``
(pure Python: which requests compute how many tokens, prefix caching, preemption),
``model_runner`` (one rank's model, KV cache and sampler; ``group_runner`` the same face over
a Ray worker group), ``llm_engine`` (a step is schedule, execute, update) and ``llm`` (the
offline API). A step's contract is ``SchedulerOutput`` in, sampled tokens out."""
