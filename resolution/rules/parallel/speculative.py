"""Speculative decoding, front half: draft revision, draft MoE runner,
algorithm name, draft window and adaptive step sizing (SGLang's
``handle_speculative_decoding``). The per-algorithm handlers are in
``speculative_algos``.

not ported: reading the draft model's config.json to detect a Gemma 4
assistant draft (NEXTN/EAGLE -> FROZEN_KV_MTP, EAGLE3 rejected): resolution
sees only the target model's config, so NEXTN and EAGLE always become EAGLE.
not ported: plugin-registered algorithms (``SpeculativeAlgorithm.register``)
and their server-args callbacks (no plugins in flotilla).
not ported: a custom ``--speculative-adaptive-config`` file (the built-in
adaptive config's candidate steps are used).
not ported: the ``SGLANG_ENABLE_SPEC_V2`` removal notice (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule

BUILTIN_ALGORITHMS = ("DFLASH", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE", "NGRAM", "NONE")
# Union of the built-in adaptive config's per-batch-size candidate steps.
ADAPTIVE_CANDIDATE_STEPS = (0, 1, 3, 7)


def algorithm_name(name):
    """The canonical algorithm for a CLI name (upper-cased; NEXTN is EAGLE)."""
    if name is None:
        return None
    upper = name.upper()
    return "EAGLE" if upper in ("NEXTN", "EAGLE") else upper


@rule("handle_speculative_decoding")
def speculative_draft_revision(view, model, platform):
    """A draft model without an explicit revision loads its ``main`` revision."""
    if view.speculative_draft_model_path is not None and view.speculative_draft_model_revision is None:
        return {"speculative_draft_model_revision": "main"}
    return None


@rule("_speculative_moe_runner_default", whitelist=True)
def speculative_moe_runner_default(view, model, platform):
    """The draft model's MoE runner defaults to the target model's resolved runner."""
    if view.speculative_moe_runner_backend is None:
        return {"speculative_moe_runner_backend": view.moe_runner_backend}
    return None


@rule("handle_speculative_decoding", overrides=("speculative_algorithm",))
def speculative_algorithm(view, model, platform):
    """The speculative algorithm name is upper-cased and NEXTN becomes EAGLE; unknown names and bad draft windows are rejected."""
    algorithm = algorithm_name(view.speculative_algorithm)
    declared = {"speculative_algorithm": algorithm}
    window = view.speculative_draft_window_size
    if window is not None:
        window = int(window)
        if window <= 0:
            reject(f"--speculative-draft-window-size must be positive, got {window}.")
        declared["speculative_draft_window_size"] = window
    if algorithm is not None and algorithm not in BUILTIN_ALGORITHMS:
        reject(f"Unknown speculative algorithm name: {algorithm}")
    if view.speculative_skip_dp_mlp_sync:
        ensure(
            algorithm == "EAGLE",
            "--speculative-skip-dp-mlp-sync is only supported with "
            f"speculative_algorithm == EAGLE, got {algorithm}.",
        )
    return declared


def adaptive_unsupported_reason(view):
    """Why adaptive speculative steps cannot run with this configuration, or None."""
    if view.speculative_algorithm not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={view.speculative_algorithm} (only EAGLE/EAGLE3 are supported)"
    if view.speculative_eagle_topk is not None and view.speculative_eagle_topk != 1:
        return f"speculative_eagle_topk={view.speculative_eagle_topk} (only topk=1 is supported)"
    if view.enable_dp_attention:
        return "enable_dp_attention=True is not supported"
    if view.enable_multi_layer_eagle:
        return "enable_multi_layer_eagle=True is not supported"
    if view.enable_two_batch_overlap:
        return "enable_two_batch_overlap=True is not supported"
    if view.enable_pdmux:
        return "enable_pdmux=True is not supported"
    return None


@rule("_maybe_disable_adaptive", overrides=("speculative_adaptive",))
def maybe_disable_adaptive(view, model, platform):
    """Adaptive speculative steps fall back to static ones outside EAGLE/EAGLE3 top-1 without DP attention, multi-layer EAGLE, TBO or PD-mux."""
    if view.speculative_adaptive and adaptive_unsupported_reason(view) is not None:
        return {"speculative_adaptive": False}
    return None


@rule(
    "_init_adaptive_speculative_params",
    overrides=("speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens"),
)
def init_adaptive_speculative_params(view, model, platform):
    """Adaptive speculative decoding starts at top-1 and the middle candidate step; draft tokens are steps + 1."""
    if not view.speculative_adaptive:
        return None
    declared = {}
    if view.speculative_eagle_topk is None:
        declared["speculative_eagle_topk"] = 1
    steps = view.speculative_num_steps
    if steps is None:
        steps = ADAPTIVE_CANDIDATE_STEPS[len(ADAPTIVE_CANDIDATE_STEPS) // 2]
        declared["speculative_num_steps"] = steps
    if steps not in ADAPTIVE_CANDIDATE_STEPS:
        reject(
            f"--speculative-num-steps={steps} "
            f"is not in the adaptive config candidate_steps {list(ADAPTIVE_CANDIDATE_STEPS)}. "
            "Pass one of those values."
        )
    declared["speculative_num_draft_tokens"] = steps + 1
    return declared
