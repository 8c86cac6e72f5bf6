"""The expert-load recorder (``stat`` mode): unit counts against a torch bincount of the
router's ids, and an in-process engine on a tiny Qwen3-MoE whose per-layer counts equal the
HF model's own router choices on the same tokens."""

import pickle

import pytest
import torch

from flotilla.cluster.models.expert_load import ExpertLoadRecorder

E, K = 8, 2


def _ids(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)]).reshape(tokens, K)


def _bincount(*batches: torch.Tensor) -> list[int]:
    return torch.bincount(torch.cat([b.reshape(-1) for b in batches]), minlength=E).tolist()


def test_counts_equal_bincount_per_layer_and_summed():
    recorder = ExpertLoadRecorder(num_layers=2, num_experts=E, layer_ids=[0, 2])
    a, b, c = _ids(7, 0), _ids(5, 1), _ids(11, 2)
    recorder.record(0, a)
    recorder.end_pass()
    recorder.record(0, b)
    recorder.record(1, c)
    snap = pickle.loads(pickle.dumps(recorder.snapshot()))
    assert snap["layer_ids"] == [0, 2]
    assert snap["per_layer"] == [_bincount(a, b), _bincount(c)]
    assert snap["total"] == _bincount(a, b, c)
    assert snap["num_passes"] == 1 and snap["window"] is None
    assert all(type(x) is int for row in snap["per_layer"] for x in row)


def test_empty_batches_add_nothing():
    recorder = ExpertLoadRecorder(num_layers=1, num_experts=E)
    recorder.record(0, torch.empty(0, K, dtype=torch.int32))
    recorder.end_pass()
    assert recorder.snapshot()["total"] == [0] * E
    ids = _ids(3, 4)
    recorder.record(0, ids)
    recorder.record(0, torch.empty(0, K, dtype=torch.int64))
    assert recorder.snapshot()["total"] == _bincount(ids)


def test_reset_forgets_everything():
    recorder = ExpertLoadRecorder(num_layers=1, num_experts=E, window=2)
    recorder.record(0, _ids(4, 5))
    recorder.end_pass()
    recorder.record(0, _ids(4, 6))
    recorder.reset()
    snap = recorder.snapshot()
    assert snap["total"] == [0] * E and snap["num_passes"] == 0


@pytest.mark.parametrize("window", [None, -1, 1, 3])
def test_window_keeps_the_last_passes(window):
    """A ring of ``window`` forward passes (SGLang's buffer size); None or -1: cumulative."""
    recorder = ExpertLoadRecorder(num_layers=1, num_experts=E, window=window)
    passes = [_ids(3 + i, 10 + i) for i in range(5)]
    for ids in passes:
        recorder.record(0, ids)
        recorder.end_pass()
    kept = passes if window in (None, -1) else passes[-window:]
    assert recorder.snapshot()["total"] == _bincount(*kept)
    assert recorder.snapshot()["window"] == (None if window in (None, -1) else window)


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="buffer_size=0"):
        ExpertLoadRecorder(num_layers=1, num_experts=E, window=0)


def test_recorder_off_by_default():
    from flotilla.cluster.models.moe_layer import FusedMoE

    assert FusedMoE(E, K, 16, 8, renormalize=True).load_recorder is None


# -- engine level -------------------------------------------------------------------------

NEW_TOKENS = 12
PROMPT_LENS = (5, 17, 40)


def test_engine_counts_match_hf_router_choices(tmp_path):
    """``LLM(..., expert_distribution_recorder_mode="stat")``: after greedy generation each
    sparse layer counted exactly (tokens processed) x top_k pairs, and the counts per logical
    expert equal a bincount of the HF model's router top-k over the same tokens (each prompt
    plus its generated tokens but the last, which is sampled and never fed back).

    The routes are compared exactly (HF reads the engine's own tokens, so only routing must
    agree): the engine's router logits (packed weights, batched steps) and HF's differ by
    float32 summation order (~1e-6), and the closest last-chosen / first-unchosen experts here
    are 2.5e-4 apart in routing probability, so no route hinges on a near-tie."""
    from flotilla import LLM, SamplingParams
    from helpers.prompts import random_prompts
    from helpers.tiny_moe import save_tiny_qwen3_moe

    hf = save_tiny_qwen3_moe(tmp_path)
    prompts = random_prompts(PROMPT_LENS, 256)
    llm = LLM(str(tmp_path), max_total_tokens=1024, expert_distribution_recorder_mode="stat")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        snap = llm.engine.runner.expert_load()
    finally:
        llm.shutdown()
    top_k = hf.config.num_experts_per_tok
    assert snap["layer_ids"] == [0, 2]  # layer 1 is dense (mlp_only_layers)
    assert snap["window"] == 1000  # resolution: buffer size 1000 forward passes when unset
    processed = sum(len(p) + NEW_TOKENS - 1 for p in prompts)
    assert [sum(row) for row in snap["per_layer"]] == [processed * top_k] * 2
    assert sum(snap["total"]) == 2 * processed * top_k

    chosen: dict[int, list[torch.Tensor]] = {0: [], 2: []}
    hooks = [
        hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen[i].append(out[2]))
        for i in chosen
    ]
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            sequence = prompt + out.outputs[0].token_ids[:-1]
            hf(torch.tensor([sequence]))
    for hook in hooks:
        hook.remove()
    num_experts = hf.config.num_experts
    expected = [torch.bincount(torch.cat(chosen[i]).reshape(-1), minlength=num_experts).tolist() for i in chosen]
    assert snap["per_layer"] == expected
    assert snap["total"] == [a + b for a, b in zip(*expected)]
