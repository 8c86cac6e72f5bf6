"""Pipeline parallelism's overlap-schedule pass and the LayerNorm sequence
parallelism checks (SGLang's ``_pipeline_parallel_overlap_disable`` and
``handle_layernorm_sp``).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule

# Architectures whose layers implement LayerNorm sequence parallelism.
LAYERNORM_SP_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})


@rule("_pipeline_parallel_overlap_disable", whitelist=True)
def pipeline_parallel_overlap_disable(view, model, platform):
    """Pipeline parallelism cannot run the overlap schedule."""
    if view.pp_size > 1:
        return {"disable_overlap_schedule": True}
    return None


@rule("handle_layernorm_sp")
def handle_layernorm_sp(view, model, platform):
    """LayerNorm sequence parallelism needs a supporting model, TP > 1, no DP attention and no speculative decoding.

    NOTE: runs after speculative decoding so ``speculative_algorithm`` is final.
    """
    if not view.enable_layernorm_sp:
        return None
    arch = model.architectures[0] if model.architectures else None
    if arch not in LAYERNORM_SP_ARCHITECTURES:
        reject(
            "--enable-layernorm-sp is only supported for "
            f"{sorted(LAYERNORM_SP_ARCHITECTURES)}; got {arch}."
        )
    if view.tp_size <= 1:
        reject(
            "--enable-layernorm-sp requires tp_size > 1: there is no sequence to "
            "shard across a single TP rank."
        )
    if view.enable_dp_attention:
        reject(
            "--enable-layernorm-sp is not compatible with --enable-dp-attention: "
            "SP shards the sequence across the full TP group, which under DP "
            "attention spans data-parallel groups holding different sequences."
        )
    if view.speculative_algorithm is not None:
        reject(
            "--enable-layernorm-sp is not compatible with speculative decoding "
            "(EAGLE/EAGLE3): the captured aux hidden states would be "
            "sequence-sharded."
        )
    return None
