"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in the
weight-absorbed form.

The cache holds one ``[R + Dr]`` row per token: the compressed KV latent ``c``
(``kv_lora_rank`` = R, already normalised by the model) and the shared rotary key
``k_pe``. Instead of expanding every cached latent into per-head keys and values,
the up-projections are folded into the query and the output:

    score(t, s) = (q_nope[t] @ W_uk) . c[s] + q_pe[t] . k_pe[s]
    out[t]      = (sum_s p(t, s) c[s]) @ W_uv

which equals attention with ``k = [c W_uk^T, k_pe]``, ``v = c W_uv`` exactly in real
arithmetic.
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention import (
    AttentionMetadata,
    causal_context_mask,
    gather_kv,
    pad_queries,
    unpad_queries,
    write_kv,
)
from flotilla.kernels.registry import register


@register("mla_attention", "torch")
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA of the new tokens over their whole paged latent context.

    Args:
        q_nope: ``[T, H, Dn]`` non-rotary query part.
        q_pe: ``[T, H, Dr]`` rotary query part (already rotated).
        kv_c: ``[T, R]`` new tokens' latents.
        k_pe: ``[T, Dr]`` new tokens' rotary keys (already rotated), shared by all heads.
        cache: ``[num_blocks, block_size, 1, R + Dr]`` latent cache; the new rows are
            written at ``meta.slot_mapping`` before attending.
        meta: the step's batch layout.
        w_kc: ``[H, Dn, R]`` key up-projection (``k_nope[h] = W_kc[h] @ c``).
        w_vc: ``[H, R, Dv]`` value up-projection (``v[h] = c @ W_vc[h]``).
        scale: softmax scale (the model folds in DeepSeek's YaRN mscale).
        return_lse: also return the natural-log sum-exp of the scaled scores ``[T, H]``
            (float32), for merging partial attention states.

    Returns ``[T, H, Dv]`` in ``q_nope.dtype`` (computed in float32), or ``(out, lse)``.
    """
    rank = kv_c.shape[-1]
    if cache.shape[-1] != rank + k_pe.shape[-1]:
        raise ValueError(
            f"MLA cache rows are {cache.shape[-1]} wide, expected kv_lora_rank + rope dim = {rank} + {k_pe.shape[-1]}"
        )
    write_kv(cache, meta.slot_mapping, torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1))
    context, _ = gather_kv(cache, meta)  # [B, L, 1, R + Dr]
    context = context.squeeze(2).float()
    latents, rope_keys = context[..., :rank], context[..., rank:]

    q_absorbed = torch.einsum("thn,hnr->thr", q_nope.float(), w_kc.float())
    q_latent = pad_queries(q_absorbed, meta)  # [B, Q, H, R]
    q_rope = pad_queries(q_pe.float(), meta)  # [B, Q, H, Dr]
    scores = torch.einsum("bqhr,blr->bhql", q_latent, latents)
    scores = (scores + torch.einsum("bqhd,bld->bhql", q_rope, rope_keys)) * scale
    mask = causal_context_mask(meta).unsqueeze(1)  # [B, 1, Q, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Q]; -inf on padding queries
    # NOTE: padding queries see nothing; zeroing their probabilities keeps NaN out.
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    out_latent = unpad_queries(torch.einsum("bhql,blr->bqhr", probs, latents), meta)  # [T, H, R]
    out = torch.einsum("thr,hrd->thd", out_latent, w_vc.float()).to(q_nope.dtype)
    if return_lse:
        return out, unpad_queries(lse.transpose(1, 2), meta)
    return out
