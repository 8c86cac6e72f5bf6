"""Speculative decoding with block drafters: DFlash and DSpark (SGLang's
``_handle_dflash``, ``_resolve_dflash_draft_attention_backend`` and
``_handle_dspark``).

not ported: reading a separate draft checkpoint's config (DFlash block size,
DSpark gamma, DFlash ``trtllm_mha`` draft-layer check): only the target
model's config is visible, so a draft that is not bundled with the target
gets SGLang's "config unreadable" fallbacks (block size 16, no checkpoint gamma,
``trtllm_mha`` falls back to the platform draft backend).
not ported: the ragged-verify-mode warnings (logging only; the mode variable
is never declared, so it is ``static``).
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.live import Live
from flotilla.resolution.rules.parallel.speculative_algos import (
    default_max_running_requests,
    device_of,
    draft_is_target,
)

DFLASH_DRAFT_BACKENDS = ("flashinfer", "fa3", "fa4", "triton", "trtllm_mha", "ascend")
DSPARK_BUNDLE_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
DEFAULT_DSPARK_GAMMA = 7
DEFAULT_DFLASH_BLOCK_SIZE = 16


def _single_step_single_branch(live: Live) -> None:
    """DFlash and DSpark draft one block: num_steps and topk are forced to 1."""
    for name in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(live, name)
        if value is None or int(value) != 1:
            live.declare(**{name: 1})


def _dflash_block_size(live: Live, model):
    """The DFlash block size of a bundled draft's config, else the unreadable-config default."""
    if draft_is_target(live):
        dflash = model.get("dflash_config")
        dflash = dflash if isinstance(dflash, Mapping) else {}
        size = dflash.get("block_size", model.get("block_size"))
        if size is not None:
            return int(size)
    return DEFAULT_DFLASH_BLOCK_SIZE


def _dflash_draft_attention_backend(live: Live, platform) -> str:
    """The draft worker's attention backend: explicit, else the target's prefill backend,
    else (or when unsupported, or ``trtllm_mha`` whose draft-layer check needs the
    draft config) FlashInfer on CUDA and Triton on ROCm."""
    fallback = "triton" if platform.is_hip else "flashinfer"
    backend = live.speculative_draft_attention_backend
    if backend is None:
        backend, _ = attention_backends(live)
    if backend is None or backend == "trtllm_mha" or backend not in DFLASH_DRAFT_BACKENDS:
        return fallback
    return backend


_DFLASH_OVERRIDES = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_attention_backend",
)


@rule("_handle_dflash", overrides=_DFLASH_OVERRIDES)
def handle_dflash(view, model, platform):
    """DFlash drafts one block per step (steps = topk = 1, draft tokens = block size) on CUDA/NPU without DP attention or PP."""
    if view.speculative_algorithm != "DFLASH":
        return None
    device = device_of(view, platform)
    if not (device.startswith("cuda") or device == "npu"):
        reject("DFLASH speculative decoding only supports CUDA and NPU devices.")
    if view.enable_dp_attention:
        reject("Currently DFLASH speculative decoding does not support dp attention.")
    if view.pp_size != 1:
        reject("Currently DFLASH speculative decoding only supports pp_size == 1.")
    if view.speculative_draft_model_path is None:
        reject("DFLASH speculative decoding requires setting --speculative-draft-model-path.")
    live = Live(view)
    _single_step_single_branch(live)
    block = view.speculative_dflash_block_size
    if block is not None:
        if int(block) <= 0:
            reject(f"DFLASH requires --speculative-dflash-block-size to be positive, got {block}.")
        tokens = view.speculative_num_draft_tokens
        if tokens is not None and int(tokens) != int(block):
            reject(
                "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set "
                "but they differ. For DFLASH they must match. "
                f"speculative_num_draft_tokens={tokens}, "
                f"speculative_dflash_block_size={block}."
            )
        live.declare(speculative_num_draft_tokens=int(block))
    if live.speculative_num_draft_tokens is None:
        live.declare(speculative_num_draft_tokens=_dflash_block_size(live, model))
    window = live.speculative_draft_window_size
    draft_tokens = int(live.speculative_num_draft_tokens)
    if window is not None and window < draft_tokens:
        reject(
            "--speculative-draft-window-size must be >= "
            "--speculative-num-draft-tokens (block_size). "
            f"window_size={window}, block_size={draft_tokens}."
        )
    live.declare(speculative_draft_attention_backend=_dflash_draft_attention_backend(live, platform))
    default_max_running_requests(live)
    return live.out


def _dspark_layout_checks(view, npu: bool) -> None:
    """DSpark with real DP attention needs the DP LM head and a TP or MegaMoE expert path."""
    if not (view.enable_dp_attention and view.dp_size > 1):
        return
    if not view.enable_dp_lm_head:
        reject("DSpark with dp attention requires --enable-dp-lm-head.")
    a2a = view.moe_a2a_backend
    if not npu and a2a not in ("none", "megamoe"):
        reject(
            "DSpark with dp attention supports moe_a2a_backend 'none' "
            "(built-in TP MoE) or 'megamoe', got "
            f"{a2a!r}."
        )
    # NOTE: the non-"none" A2A case needs SGLANG_RAGGED_VERIFY_MODE=static,
    # which is what the (never declared) variable reads as.
    if view.attn_cp_size > 1:
        reject(
            "DSpark with dp attention does not support context parallel "
            f"(attn_cp_size={view.attn_cp_size})."
        )
    draft_a2a = view.speculative_moe_a2a_backend
    if not npu and draft_a2a is not None and draft_a2a != a2a:
        reject(
            "DSpark ignores --speculative-moe-a2a-backend; with dp attention it "
            f"must match the target moe_a2a_backend={a2a!r} "
            f"(got {draft_a2a!r})."
        )


def _dspark_checkpoint_gamma(live: Live, model):
    """Gamma from a bundled draft's config (the target's own), else None."""
    if not draft_is_target(live):
        return None
    gamma = model.get("dspark_block_size")
    if gamma is None:
        dflash = model.get("dflash_config")
        gamma = dflash.get("block_size") if isinstance(dflash, Mapping) else None
        gamma = model.get("block_size") if gamma is None else gamma
    return int(gamma) if gamma is not None else None


@rule(
    "_handle_dspark",
    overrides=("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"),
)
def handle_dspark(view, model, platform):
    """DSpark verifies gamma + 1 tokens in one step (steps = topk = 1); a bundled draft head defaults the draft path to the target."""
    if view.speculative_algorithm != "DSPARK":
        return None
    device = device_of(view, platform)
    npu = device.startswith("npu")
    if not device.startswith(("cuda", "npu")):
        reject("DSpark speculative decoding only supports CUDA or NPU device.")
    _dspark_layout_checks(view, npu)
    if view.pp_size != 1:
        reject("Currently DSpark speculative decoding only supports pp_size == 1.")
    live = Live(view)
    if view.speculative_draft_model_path is None:
        if any(model.get(key) is not None for key in DSPARK_BUNDLE_KEYS):
            live.declare(speculative_draft_model_path=view.model_path, speculative_draft_model_revision=view.revision)
        else:
            reject("DSpark dense speculative decoding requires setting --speculative-draft-model-path.")
    _single_step_single_branch(live)
    gamma = None
    if view.speculative_dspark_block_size is not None:
        if int(view.speculative_dspark_block_size) <= 0:
            reject(
                "DSpark requires --speculative-dspark-block-size to be positive, "
                f"got {view.speculative_dspark_block_size}."
            )
        gamma = int(view.speculative_dspark_block_size)
    else:
        gamma = _dspark_checkpoint_gamma(live, model)
        if gamma is None and view.speculative_num_draft_tokens is None:
            gamma = DEFAULT_DSPARK_GAMMA
    if gamma is not None:
        window = gamma + 1
        tokens = view.speculative_num_draft_tokens
        if tokens is not None and int(tokens) != window:
            reject(
                "DSpark speculative_num_draft_tokens must equal gamma + 1 "
                f"(= {window} for gamma={gamma}), but got "
                f"speculative_num_draft_tokens={tokens}."
            )
        live.declare(speculative_num_draft_tokens=window)
    tokens = live.speculative_num_draft_tokens
    if tokens is None:
        reject(
            "DSpark could not resolve speculative_num_draft_tokens; set "
            "--speculative-dspark-block-size (= gamma)."
        )
    if int(tokens) < 2:
        reject(f"DSpark speculative_num_draft_tokens must be >= 2 (= gamma + 1), got {tokens}.")
    default_max_running_requests(live)
    return live.out


STEPS = [handle_dflash, handle_dspark]
