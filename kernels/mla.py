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

Under decode context parallelism (``local``: a :class:`~flotilla.kernels.dcp.DCPLocalView`)
the same kernel runs over one rank's token shard of the cache: it writes only the new
tokens the rank owns (at their local slots), gathers the rank's local context, and masks
by TRUE positions; the caller merges the shards' partial outputs with their LSEs.
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
from flotilla.kernels.dcp import DCPLocalView
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
    local: DCPLocalView | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA of the new tokens over their whole paged latent context (with ``local``:
    over one DCP rank's shard of it).

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
        local: attend over this DCP rank's shard only: ``cache`` is the rank's local cache
            (blocks of ``local.meta.block_size``), only the new tokens ``local.write_index``
            are written (at ``local.meta.slot_mapping``), and ``local.mask`` (true positions)
            decides what each query sees. ``meta`` is then unused.
        keep: ``[B, max_query_len, L]`` bool (``L``: the context length attended, the local one
            with ``local``): attend only where it is True, on top of causality (DeepSeek sparse
            attention's top-k selection, see :mod:`flotilla.kernels.dsa`); None: every key.

    Returns ``[T, H, Dv]`` in ``q_nope.dtype`` (computed in float32), or ``(out, lse)``. A
    query that sees no key (a DCP shard holding none of its context) gets ``out = 0`` and
    ``lse = -inf``. ``T = 0`` (an idle rank's empty batch) returns empty tensors.
    """
    rank = kv_c.shape[-1]
    if cache.shape[-1] != rank + k_pe.shape[-1]:
        raise ValueError(
            f"MLA cache rows are {cache.shape[-1]} wide, expected kv_lora_rank + rope dim = {rank} + {k_pe.shape[-1]}"
        )
    heads = q_nope.shape[1]
    if q_nope.shape[0] == 0:
        out = q_nope.new_zeros(0, heads, w_vc.shape[-1])
        return (out, torch.zeros(0, heads, dtype=torch.float32, device=q_nope.device)) if return_lse else out
    rows = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
    if local is None:
        write_kv(cache, meta.slot_mapping, rows)
        mask = causal_context_mask(meta)
    else:
        if cache.shape[1] != local.meta.block_size:
            raise ValueError(
                f"DCP-local MLA: cache blocks hold {cache.shape[1]} tokens, expected the local block size "
                f"{local.meta.block_size} (logical block size / dcp_size={local.dcp_size})"
            )
        write_kv(cache, local.meta.slot_mapping, rows.index_select(0, local.write_index))
        meta, mask = local.meta, local.mask
    context, _ = gather_kv(cache, meta)  # [B, L, 1, R + Dr]
    context = context.squeeze(2).float()
    latents, rope_keys = context[..., :rank], context[..., rank:]

    q_absorbed = torch.einsum("thn,hnr->thr", q_nope.float(), w_kc.float())
    q_latent = pad_queries(q_absorbed, meta)  # [B, Q, H, R]
    q_rope = pad_queries(q_pe.float(), meta)  # [B, Q, H, Dr]
    scores = torch.einsum("bqhr,blr->bhql", q_latent, latents)
    scores = (scores + torch.einsum("bqhd,bld->bhql", q_rope, rope_keys)) * scale
    if keep is not None:
        mask = mask & keep
    mask = mask.unsqueeze(1)  # [B, 1, Q, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Q]; -inf where a query sees nothing
    # NOTE: padding queries (and queries with an empty DCP shard) see nothing; zeroing their
    # probabilities keeps NaN out.
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
    out_latent = unpad_queries(torch.einsum("bhql,blr->bqhr", probs, latents), meta)  # [T, H, R]
    out = torch.einsum("thr,hrd->thd", out_latent, w_vc.float()).to(q_nope.dtype)
    if return_lse:
        return out, unpad_queries(lse.transpose(1, 2), meta)
    return out
