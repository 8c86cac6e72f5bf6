"""The legacy context-parallel alias rule, run a second time in the parallel phase.

SGLang re-applies ``handle_legacy_cp_arguments`` after the model defaults have
settled ``attention_backend``, so the canonical CP flags mirror onto the right
legacy aliases (DSA vs. non-DSA). The rule belongs to the normalise phase; the
same rule object is reused here.
"""

from flotilla.resolution.rules.normalise.legacy import handle_legacy_cp_arguments

__all__ = ["handle_legacy_cp_arguments"]
