"""flotilla: a Ray-native LLM serving cluster.

The subpackages are the repository's top-level folders:

- ``flotilla.resolution``: the pure configuration resolver (no torch, no ray).
- ``flotilla.kernels``: named kernel backends per op.
- ``flotilla.cluster``: what runs on the Ray actors.
- ``flotilla.serve``: the request side (Ray Serve, OpenAI API).
- ``flotilla.deploy``: the ``flotilla`` CLI and deployment recipes.

The offline API (``from flotilla import LLM, SamplingParams``) arrives with the
engine; this root module stays free of heavy imports so that ``flotilla resolve``
starts in well under a second.
"""

__version__ = "0.1.0"
