"""flotilla.kernels: the ops the models call (attention, MLA, DSA, MoE, norms, RoPE,
activations, sampling, FP8 GEMMs, the DCP merge), each under named backends looked up in
``registry`` (``get(op, backend)``).

Contract: every op has a ``torch`` backend that runs anywhere and is the tests' oracle;
CUDA backends (``flashinfer``, ``triton``, ``deep_gemm``) import their library only when
asked for, and a missing one is a clear error at start. Kernels know tensors and step
metadata, never requests, configs or Ray.
"""

if __name__ == "kernels":
    # The repository root is the package ``flotilla`` (pyproject's package-dir), so wherever the
    # root itself is on sys.path (``python -m pytest`` run from the checkout, or a Ray worker of
    # a driver started there: Ray adds the driver's working directory to its workers' path) this
    # folder is also importable as a top-level ``kernels`` and would shadow Hugging Face's
    # ``kernels`` distribution, which transformers>=5.25 imports when it starts. Imported under
    # that name, this module hands the name to the installed distribution: importlib returns
    # whatever sys.modules holds for the name once this body has run.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ImportError(
            f"'import kernels' found flotilla's own kernels folder ({os.path.dirname(__file__)}) "
            "through the checkout's root on sys.path, and no installed 'kernels' distribution: "
            "import flotilla.kernels instead"
        )
    _distribution = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _distribution
    _spec.loader.exec_module(_distribution)
