"""flotilla.serve: the Serve application, in the driver and in its replicas.

- ``plan``: flags, model and platform -> a ``ServePlan`` (each pool's config, elastic EP
  joiners, serving options), once, in the driver;
- ``app``: the builders (``build_application``: ingress + engine pools) and ``serve run``'s
  ``build``;
- ``ingress``/``protocol``/``prompts``/``responses``/``request_log``: the OpenAI API;
- ``engine_replica``/``async_engine*``: an engine replica and its engine thread;
- ``router``, ``pd``, ``elastic_ep``, ``ep_autoscale*``, ``metrics``, ``handles``, ``types``:
  routing, the PD client, elastic EP control, metrics, and what crosses the boundaries.

Contract: imports ``cluster`` (and ``resolution``), never ``deploy``; replicas receive the
plan's frozen configs and resolve nothing.
"""
