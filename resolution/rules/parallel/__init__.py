"""Rules of the parallel phase, in the order they run (see STEPS).

The order is SGLang 0.5.19's resolution pipeline from ``handle_data_parallelism``
through ``validate_cutedsl_a2a_token_budget``; each SGLang handler that declares,
reads its own declaration and declares again is one rule that tracks its own
declarations (``live.Live``), or consecutive rules.
"""

from flotilla.resolution.rules.parallel import (
    a2a,
    context_parallel,
    data_parallel,
    elastic_ep,
    eplb,
    legacy_cp,
    moe_kernels,
    pipeline,
    speculative,
    speculative_algos,
    speculative_blocks,
)

STEPS: list = [
    # handle_data_parallelism
    *data_parallel.STEPS,
    data_parallel.handle_load_balance_method,
    # NOTE: the legacy CP aliases are re-derived now that attention_backend is
    # final, so DSA models mirror CP onto the DSA aliases.
    legacy_cp.handle_legacy_cp_arguments,
    context_parallel.handle_context_parallelism,
    # handle_moe_kernel_config
    moe_kernels.moe_runner_backend_quant_constraints,
    moe_kernels.handle_moe_kernel_config,
    moe_kernels.moe_runner_fusion_disable,
    # handle_a2a_moe
    *a2a.STEPS,
    eplb.handle_eplb_and_dispatch,
    eplb.handle_expert_distribution_metrics,
    elastic_ep.handle_elastic_ep,
    moe_kernels.validate_experimental_sgl_marlin,
    pipeline.pipeline_parallel_overlap_disable,
    # handle_speculative_decoding
    speculative.speculative_draft_revision,
    speculative.speculative_moe_runner_default,
    speculative.speculative_algorithm,
    speculative.maybe_disable_adaptive,
    speculative.init_adaptive_speculative_params,
    *speculative_blocks.STEPS,
    *speculative_algos.STEPS,
    # NOTE: both read the final speculative settings.
    pipeline.handle_layernorm_sp,
    a2a.validate_cutedsl_a2a_token_budget,
]
