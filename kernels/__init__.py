"""flotilla.kernels: the ops the models call (attention, MLA, DSA, MoE, norms, RoPE,
activations, sampling, FP8 GEMMs, the DCP merge), each under named backends looked up in
``registry`` (``get(op, backend)``).

Contract: every op has a ``torch`` backend that runs anywhere and is the tests' oracle;
CUDA backends (``flashinfer``, ``triton``, ``deep_gemm``) import their library only when
asked for, and a missing one is a clear error at start. Kernels know tensors and step
metadata, never requests, configs or Ray.
"""
