"""MTP (next-n) layers load into the draft module and compute what transformers computes.

Each case saves a tiny random main model with one MTP layer in DeepSeek's checkpoint layout
(``model.layers.<L>.enorm`` / ``hnorm`` / ``eh_proj`` / the decoder block's tensors with one per
expert matrix / ``shared_head.norm``, plus the layer's copies of the embedding and LM head). The
oracle is transformers 5.24's own MTP module for DeepSeek-V3 and GLM-4.5 (``MtpModel``, as
``generate(use_mtp=True)`` builds it); transformers has none for the DSA models, so for
DeepSeek-V3.2 and GLM-5 it is transformers' ``MtpLayer`` around their own decoder layer (a full
DSA layer with its indexer), assembled here. The draft runs over its own paged cache, the
sequence fed in two chunks (the second reads the first's cached latents and indexer keys).

Tolerance: atol 1e-4 on logits of magnitude ~5, float32: one decoder block plus two norms and a
projection, in another summation order (~1e-6); a swapped enorm/hnorm, a missing post-norm or a
block built dense moves them by 1e-1. The DSA cases' top-k boundaries are checked to be wider
than 1e-4 (see test_dsa.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flotilla.cluster.models.fp8_moe import Fp8FusedMoE
from flotilla.cluster.models.moe_layer import moe_layers
from flotilla.cluster.models.mtp import MTPDraft
from flotilla.cluster.models.sources import load_model, resolve_model_source
from helpers.paged import build_meta
from helpers.tiny_dsa import (
    SelectionMargins,
    add_checkpoint_tensors,
    mtp_checkpoint_tensors,
    save_fp8_twin,
    tiny_dsa,
)
from helpers.tiny_deepseek import TINY_DEEPSEEK_V3_MTP
from helpers.tiny_fp8 import randomize
from helpers.tiny_glm import randomize_correction_bias, tiny_glm4_moe
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-4
TOKENS, FIRST_CHUNK, BLOCK = 20, 12, 4
_V3 = TINY_DEEPSEEK_V3_MTP


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


def _randomized(module, seed: int):
    randomize(module, seed)
    randomize_correction_bias(module, seed)
    return module.eval()


def _hf_main(case: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if case == "deepseek_v3":
        torch.manual_seed(0)
        return _randomized(DeepseekV3ForCausalLM(DeepseekV3Config(**_V3)), 0)
    if case == "glm4_moe":
        return tiny_glm4_moe(num_nextn_predict_layers=1)
    return tiny_dsa(case)


def _hf_mtp_layer(main, case: str):
    """``(mtp_state, forward(ids, hidden) -> logits)``: transformers' MTP layer 0 of ``main``."""
    from transformers.modeling_layers import MtpLayer, MtpModel

    if case in ("deepseek_v3", "glm4_moe"):
        mtp = _randomized(MtpModel(main, 1), 7)
        positions = torch.arange(TOKENS)[None]

        def forward(ids, hidden):
            out = mtp.forward_layer(0, hidden[None], positions, None, input_ids=ids[None])
            return mtp._project_to_logits(out)[0]

        return mtp.state_dict(), forward
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer, DeepseekV32RMSNorm
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    class Glm5Block(GlmMoeDsaDecoderLayer):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)[0]  # the hidden state (not the top-k it passes on)

    config = copy.deepcopy(main.config)
    config.num_hidden_layers, config.mlp_layer_types = 1, ["sparse"]
    if case == "glm5":
        config.indexer_types = ["full"]
    block = DeepseekV32DecoderLayer if case == "deepseek_v32" else Glm5Block
    layer = _randomized(MtpLayer(config, block, DeepseekV32RMSNorm, 0), 7)
    positions = torch.arange(TOKENS)[None]
    causal = torch.tril(torch.ones(TOKENS, TOKENS, dtype=torch.bool))[None, None]

    def forward(ids, hidden):
        embedded = main.model.embed_tokens(ids[None])
        out = layer(embedded, hidden[None], main.model.rotary_emb(embedded, positions), causal, positions, None)
        return main.lm_head(out)[0]

    return {f"layers.0.{k}": v for k, v in layer.state_dict().items()}, forward


def _save(main, mtp_state, path):
    main.save_pretrained(path)
    first = main.config.num_hidden_layers
    add_checkpoint_tensors(path, mtp_checkpoint_tensors(main, mtp_state, first))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


def _draft_logits(draft: MTPDraft, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The draft over its own paged cache, in two chunks."""
    caches = draft.kv_cache_spec().allocate(8, BLOCK)
    table, out = [[3, 1, 6, 2, 7, 5]], []
    with torch.no_grad():
        for start, end in ((0, FIRST_CHUNK), (FIRST_CHUNK, TOKENS)):
            meta = build_meta([(start, end - start)], table, BLOCK)
            positions = torch.arange(start, end)
            out.append(draft.compute_logits(draft(ids[start:end], positions, hidden[start:end], caches, meta)))
    return torch.cat(out)


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe", "deepseek_v32", "glm5"])
def test_the_draft_module_computes_transformers_mtp_layer(case, tmp_path):
    main = _hf_main(case)
    state, hf_forward = _hf_mtp_layer(main, case)
    _save(main, state, tmp_path)
    ours = load_model(resolve_model_source(str(tmp_path)), "float32")  # NOTE: checks the draft is complete
    assert isinstance(ours.mtp, MTPDraft) and ours.mtp.first == main.config.num_hidden_layers
    assert [i for i, _ in moe_layers(ours)] == list(range(1, main.config.num_hidden_layers))  # the draft's experts stay out
    margins = SelectionMargins().attach(ours.mtp)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (TOKENS,), generator=generator)
    hidden = torch.randn(TOKENS, main.config.hidden_size, generator=generator)
    with torch.no_grad():
        expected = hf_forward(ids, hidden)
    torch.testing.assert_close(_draft_logits(ours.mtp, ids, hidden), expected, atol=ATOL, rtol=0)
    assert margins.smallest >= 1e-4


def test_an_fp8_checkpoints_mtp_layer_loads_its_fp8_experts(tmp_path):
    """DeepSeek-V3 as published: the MTP layer's experts FP8 (FP8 layers in the draft), its
    attention projections dequantized; the draft equals the one of the dequantized twin."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    settings = dict(
        _V3, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=384,
    )  # fmt: skip
    torch.manual_seed(0)
    main = _randomized(DeepseekV3ForCausalLM(DeepseekV3Config(**settings)), 0)
    state, _ = _hf_mtp_layer(main, "deepseek_v3")
    fp8_dir, dequant_dir = save_fp8_twin(main, tmp_path, extra=mtp_checkpoint_tensors(main, state, 2))
    fp8 = load_model(resolve_model_source(str(fp8_dir)), "float32")
    plain = load_model(resolve_model_source(str(dequant_dir)), "float32")
    assert isinstance(fp8.mtp.layers[0].block.mlp.experts, Fp8FusedMoE)
    generator = torch.Generator().manual_seed(4)
    ids, hidden = torch.randint(0, 384, (TOKENS,), generator=generator), torch.randn(TOKENS, 128, generator=generator)
    torch.testing.assert_close(_draft_logits(fp8.mtp, ids, hidden), _draft_logits(plain.mtp, ids, hidden), atol=ATOL, rtol=0)


def _v3_dir(tmp_path, **config_changes):
    main = _hf_main("deepseek_v3")
    state, _ = _hf_mtp_layer(main, "deepseek_v3")
    _save(main, state, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return main, tmp_path


def test_without_mtp_layers_in_the_config_they_are_skipped(tmp_path):
    _, path = _v3_dir(tmp_path, num_nextn_predict_layers=0)
    assert getattr(load_model(resolve_model_source(str(path)), "float32"), "mtp", None) is None


def test_an_incomplete_mtp_layer_is_refused_naming_what_is_missing(tmp_path):
    main, path = _v3_dir(tmp_path)
    from safetensors.torch import load_file, save_file

    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.2.hnorm.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MTP layers are incomplete: 1 parameter.*layers\.0\.hnorm\.weight"):
        load_model(resolve_model_source(str(path)), "float32")
    assert main.config.num_hidden_layers == 2


def test_more_mtp_layers_than_the_config_says_are_refused(tmp_path):
    main, path = _v3_dir(tmp_path)
    add_checkpoint_tensors(path, {"model.layers.3.enorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=r"MTP layer 3, but config.json says num_nextn_predict_layers=1"):
        load_model(resolve_model_source(str(path)), "float32")
