"""flotilla.cluster: what runs where the model runs: on the engine replicas and their Ray
worker actors.

- ``engine/``: one engine: pure scheduling and KV block bookkeeping (no torch), the runner
  of one rank, the step loop (``LLMEngine``) and the offline ``LLM``; ``configure`` turns
  flags into one engine's resolved config;
- ``models/``: model definitions over parallel-ready layers, weight loading;
- ``kv/``: one rank's KV transport for prefill/decode handoffs (NIXL, the Ray fallback);
- ``worker``/``group``/``compiled_steps``: the Ray worker group of a multi-rank engine;
- ``platform``, ``topology``, ``distributed``, ``elastic``, ``eplb``: the hardware probe,
  rank math, process groups, elastic EP growth, expert placement.

Contract: receives the frozen ``ResolvedConfig`` and never re-resolves it; imports
``kernels`` and ``resolution``, never ``serve`` or ``deploy``.
"""
