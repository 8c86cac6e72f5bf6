"""Legacy context-parallel aliases (seed 002 ``handle_legacy_cp_arguments``).

The old flags ``--enable-prefill-context-parallel`` (MLA/MHA models) and
``--enable-dsa-prefill-context-parallel`` (DSA models) with their
``*_cp_mode`` spellings map onto the canonical ``--enable-prefill-cp`` /
``--cp-strategy``; the canonical pair is then mirrored back onto the legacy
fields the runtime still reads.

The same rule object runs twice: here, before validations and model defaults
read ``enable_prefill_cp``/``cp_strategy``, and again in the parallel phase once
the attention backend is final (the DSA aliases depend on it).
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.live import Live

_LEGACY_MODE_TO_STRATEGY = {
    "in-seq-split": "zigzag",
    "round-robin-split": "interleave",
}
_STRATEGY_TO_LEGACY_MODE = {
    "zigzag": "in-seq-split",
    "interleave": "round-robin-split",
}
_DSA_BACKENDS = ("dsa", "dsv4")


@rule(
    "_handle_legacy_cp_arguments",
    overrides=(
        "enable_prefill_cp",
        "cp_strategy",
        "enable_dsa_prefill_context_parallel",
        "enable_prefill_context_parallel",
        "dsa_prefill_cp_mode",
        "prefill_cp_mode",
    ),
)
def handle_legacy_cp_arguments(view, model, platform):
    """Legacy prefill-CP flags imply --enable-prefill-cp and a --cp-strategy (from the
    legacy mode); the canonical pair is mirrored onto the legacy fields, on the DSA
    aliases when the DSA flag or a dsa/dsv4 attention backend is in use."""
    live = Live(view)
    if live.enable_prefill_context_parallel or live.enable_dsa_prefill_context_parallel:
        live.declare(enable_prefill_cp=True)
    # NOTE: each read below sees the declarations above (SGLang's live view).
    if live.enable_prefill_context_parallel and live.cp_strategy is None:
        live.declare(cp_strategy=_LEGACY_MODE_TO_STRATEGY[live.prefill_cp_mode])
    if live.enable_dsa_prefill_context_parallel and live.cp_strategy is None:
        live.declare(cp_strategy=_LEGACY_MODE_TO_STRATEGY[live.dsa_prefill_cp_mode])
    if live.enable_prefill_context_parallel and live.enable_dsa_prefill_context_parallel:
        return live.out
    if not live.enable_prefill_cp or live.cp_strategy is None:
        return live.out
    mode = _STRATEGY_TO_LEGACY_MODE[live.cp_strategy]
    if live.enable_dsa_prefill_context_parallel or live.attention_backend in _DSA_BACKENDS:
        live.declare(enable_dsa_prefill_context_parallel=True)
        live.declare(enable_prefill_context_parallel=False)
    else:
        live.declare(enable_prefill_context_parallel=True)
    live.declare(dsa_prefill_cp_mode=mode)
    live.declare(prefill_cp_mode=mode)
    return live.out
