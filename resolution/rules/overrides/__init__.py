"""Rules of the model phase, in SGLang 0.5.19's ``handle_model_specific_adjustments``
order (STEPS): the opening resets and architecture checks, the pre-dispatch
mamba pass, the model-override providers (one snapshot), the Kimi and DeepSeek V4
defaults, the DeepSeek/MLA/DSA branch, the other architectures' checks, the
second mamba pass, and the all-reduce fusion tail. The GLM-5.x SM120 rules from
PR 29580 close the phase.
"""

from flotilla.resolution.rules.overrides import providers  # noqa: F401  (registers the providers)
from flotilla.resolution.rules.overrides import (
    allreduce,
    arch_checks,
    cpu_dsa,
    deepseek_branch,
    deepseek_passes,
    deepseek_v4_branch,
    glm_sm120,
    kimi_k3_hook,
    mamba,
    prelude,
)
from flotilla.resolution.rules.overrides.registry import MODEL_PROVIDERS

STEPS: list = [
    prelude.model_phase_resets,
    prelude.architecture_flag_checks,
    mamba.mamba_radix_cache_pre_dispatch,
    mamba.mamba_radix_cache_pre_dispatch_checks,
    MODEL_PROVIDERS,
    kimi_k3_hook.apply_kimi_k3_linear_attn_defaults,
    kimi_k3_hook.apply_kimi_k3_spec_backend_defaults,
    deepseek_v4_branch.deepseek_v4_kv_cache_dtype,
    deepseek_v4_branch.apply_deepseek_v4_defaults,
    # The DeepSeek / MLA / DSA branch.
    deepseek_branch.dsa_dense_attention_threshold,
    deepseek_branch.dsa_prefill_cp_graph,
    # NOTE: flotilla's CPU deviation (torch reference DSA) before the GPU-only DSA passes.
    cpu_dsa.cpu_reference_dsa,
    # NOTE: the DSA kv-cache dtype reads the checkpoint's quantization before
    # _deepseek_moe_quant_resolution declares it, and the split backends read
    # the dtype this pass settles.
    deepseek_passes.dsa_kv_cache_dtype_default,
    deepseek_passes.dsa_split_backend_resolution,
    deepseek_branch.dsa_context_parallel_checks,
    deepseek_branch.mla_prefill_cp_graph,
    deepseek_passes.deepseek_moe_quant_resolution,
    deepseek_branch.dsa_rocm_topk,
    deepseek_passes.deepseek_spec_moe_resolution,
    # The DeepSeek V4 branch.
    deepseek_v4_branch.validate_deepseek_v4_cp,
    deepseek_v4_branch.validate_deepseek_v4_mega_moe_token_budget,
    deepseek_v4_branch.deepseek_v4_platform_kernels,
    arch_checks.architecture_backend_checks,
    # NOTE: the second mamba pass runs after every branch and before the
    # sparse-head switch, which also writes disable_overlap_schedule.
    mamba.mamba_radix_cache,
    mamba.mamba_radix_cache_checks,
    allreduce.sparse_head_overlap_disable,
    allreduce.flashinfer_allreduce_fusion_auto_enable,
    allreduce.enforce_disable_allreduce_fusion,
    glm_sm120.glm_dsa_sm120_decode_graph_cap,
]
