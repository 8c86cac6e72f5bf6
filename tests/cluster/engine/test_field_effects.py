"""What a non-default value of a server field changes in the in-process engine (CPU, no Ray).

Each test sets one field through ``LLM(...)`` (or resolves it with the CPU or H200 preset)
and shows the runtime acting on it against the same engine at the field's default: how many
requests run at once, how a prompt is split into steps, how many KV blocks it holds, what the
prefix cache serves, which tokens an unseeded sampler draws, which tokenizer (if any) the
engine loads, the dtypes it allocates, the host tier's size, which kernels and decode CUDA
graphs a GPU runner would choose, and how large a CUDA KV pool would be (the last three on
the decision functions the runner calls, since this box has no GPU). The runtime-support
table names these tests as evidence (``tests/helpers/support_evidence.py``).

A tiny random Llama (vocabulary 256, 16-token blocks by default); greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.cuda_graphs import decode_graph_sizes
from flotilla.cluster.engine.host_kv_tier import GB
from flotilla.cluster.engine.kernel_backends import kernel_backends_for
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama, save_word_tokenizer, word_token_ids
from helpers.tiny_moe import save_tiny_qwen3_moe
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
CPU = preset("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama without a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama-fields")
    save_tiny_llama(path, vocab_size=VOCAB)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A word-level tokenizer for the tiny Llama (token ``i`` is the word ``w<i>``), alone."""
    path = tmp_path_factory.mktemp("word-tokenizer")
    save_word_tokenizer(path, VOCAB)
    return str(path)


def llm(path: str, **flags) -> LLM:
    return LLM(path, platform=CPU, **flags)


def resolved(path: str, platform: str = "cpu", **flags):
    source = resolve_model_source(path)
    args = ServerArgs.create(model_path=str(source.path), **flags)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset(platform)), source


def record_schedules(engine) -> list:
    """Every ``SchedulerOutput`` the engine's scheduler returns from now on."""
    outputs, schedule = [], engine.scheduler.schedule

    def recorded():
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = recorded
    return outputs


def run(engine, prompts, params=GREEDY, on_step=None) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        if on_step is not None:
            on_step(engine)
    return [engine.pop_output(i).outputs[0].token_ids for i in ids]


# -- scheduling budgets ------------------------------------------------------------------------


def test_max_running_requests_caps_the_requests_running_at_once(model_dir):
    prompts = random_prompts((5, 9, 7, 12, 6), VOCAB)
    counts = {}
    for flags in ({}, {"max_running_requests": 2}):
        engine = llm(model_dir, **flags).engine
        seen: list[int] = []
        tokens = run(engine, prompts, on_step=lambda e, seen=seen: seen.append(e.scheduler.num_running))
        counts[bool(flags)] = (max(seen), tokens)
    assert counts[False][0] == 5  # by default all five run together
    assert counts[True][0] == 2
    assert counts[True][1] == counts[False][1]


def _new_tokens_of(outputs, request_id: str) -> list[int]:
    return [s.num_new_tokens for out in outputs for s in out.scheduled if s.request.request_id == request_id]


def test_chunked_prefill_size_splits_a_long_prompt_into_chunks_of_that_size(model_dir):
    (prompt,) = random_prompts((40,), VOCAB)
    chunks = {}
    for flags in ({}, {"chunked_prefill_size": 16}):
        engine = llm(model_dir, **flags).engine
        outputs = record_schedules(engine)
        rid = engine.add_request(prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        chunks[bool(flags)] = (_new_tokens_of(outputs, rid), engine.pop_output(rid).outputs[0].token_ids)
    # the prompt's prefill steps, then one token per decode step
    assert chunks[False][0] == [40] + [1] * 5
    assert chunks[True][0] == [16, 16, 8] + [1] * 5
    assert chunks[True][1] == chunks[False][1]


def test_max_prefill_tokens_is_the_step_budget_when_prefill_is_not_chunked(model_dir):
    """``--chunked-prefill-size -1``: a prompt is prefilled whole, and two 20-token prompts do
    not fit one step of 32 tokens, so the second waits for the next step (with the default
    budget of 16384 both prefill in the first step). A prompt above the budget is refused."""
    prompts = random_prompts((20, 20), VOCAB)
    first_steps = {}
    for budget in (None, 32):
        flags = {"chunked_prefill_size": -1} | ({"max_prefill_tokens": budget} if budget else {})
        engine = llm(model_dir, **flags).engine
        outputs = record_schedules(engine)
        run(engine, prompts)
        first_steps[budget] = [s.num_new_tokens for s in outputs[0].scheduled]
    assert first_steps[None] == [20, 20]
    assert first_steps[32] == [20]
    with pytest.raises(ValueError, match="more than the 32 one request may use"):
        llm(model_dir, chunked_prefill_size=-1, max_prefill_tokens=32).engine.add_request(list(range(3, 43)), GREEDY)


# -- the KV pool and the prefix cache -----------------------------------------------------------


def test_page_size_sets_the_tokens_of_each_kv_block(model_dir):
    (prompt,) = random_prompts((40,), VOCAB)
    held = {}
    for flags in ({}, {"page_size": 32}):
        engine = llm(model_dir, max_total_tokens=512, **flags).engine
        rid = engine.add_request(prompt, GREEDY)
        engine.step()  # the prefill: 40 prompt tokens in the cache
        held[bool(flags)] = (engine.runner.kv_layout.block_size, engine.runner.kv_layout.num_blocks,
                             len(engine.scheduler.get(rid).block_ids))  # fmt: skip
    assert held[False] == (16, 32, 3)
    assert held[True] == (32, 16, 2)


def test_disable_radix_cache_serves_a_repeated_prompt_without_cached_tokens(model_dir):
    (prompt,) = random_prompts((40,), VOCAB)
    cached = {}
    for flags in ({}, {"disable_radix_cache": True}):
        model = llm(model_dir, **flags)
        first, again = (model.generate([prompt], GREEDY)[0] for _ in range(2))
        cached[bool(flags)] = (first.num_cached_tokens, again.num_cached_tokens, again.outputs[0].token_ids)
    assert cached[False][:2] == (0, 32)  # the prompt's two full 16-token blocks
    assert cached[True][:2] == (0, 0)
    assert cached[True][2] == cached[False][2]


def test_context_length_bounds_a_request(model_dir):
    """The tiny model's own context is 256 tokens; ``--context-length 64`` refuses a 70-token
    prompt the default takes, and a request without max_tokens stops at 64 tokens."""
    (long_prompt,) = random_prompts((70,), VOCAB)
    assert llm(model_dir).generate([long_prompt], GREEDY)[0].outputs[0].finish_reason == "length"
    short = llm(model_dir, context_length=64)
    with pytest.raises(ValueError, match="the prompt has 70 tokens, but the context length is 64"):
        short.generate([long_prompt], GREEDY)
    (out,) = short.generate([long_prompt[:60]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_hicache_size_sizes_the_host_tier_in_gigabytes(model_dir):
    """``--hicache-size 1``: 1 GB of host slots instead of ``--hicache-ratio``'s default 2 x the
    device pool (16 slots for 8 blocks), and preempted requests load their blocks back from it."""
    prompts = random_prompts((5, 17, 33, 60), VOCAB)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    by_ratio = llm(model_dir, max_total_tokens=128, enable_hierarchical_cache=True).engine
    assert by_ratio.runner.kv_layout.host_blocks == 16
    engine = llm(model_dir, max_total_tokens=128, enable_hierarchical_cache=True, hicache_size=1).engine
    block_bytes = sum(t[0].nbytes for layer in engine.runner.kv_caches for t in layer)
    assert block_bytes == 16 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x KV heads x head dim x float32
    assert engine.runner.kv_layout.host_blocks == GB // block_bytes == engine.runner.host_kv.num_slots
    assert run(engine, prompts, params) == run(by_ratio, prompts, params)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["host_kv_loaded_blocks"] > 0, stats


# -- the model: where it comes from, how it loads, its dtypes -------------------------------------


def test_load_format_dummy_serves_a_checkpoint_without_weights(model_dir, tmp_path):
    """A directory with the tiny model's config.json only: ``auto`` finds no weights;
    ``dummy`` makes random weights of the checkpoint's shapes (not its trained values: the
    tokens differ from the saved model's)."""
    (tmp_path / "config.json").write_text((resolve_model_source(model_dir).path / "config.json").read_text())
    with pytest.raises(ValueError, match="holds no weights"):
        llm(str(tmp_path))
    prompts = random_prompts((5, 17), VOCAB)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    dummy = llm(str(tmp_path), load_format="dummy")
    tokens = [o.outputs[0].token_ids for o in dummy.generate(prompts, params)]
    assert [len(t) for t in tokens] == [12, 12]
    assert tokens != [o.outputs[0].token_ids for o in llm(model_dir).generate(prompts, params)]
    assert tokens == [o.outputs[0].token_ids for o in llm(str(tmp_path), load_format="dummy").generate(prompts, params)]


def test_dtype_sets_the_weights_and_the_kv_cache(model_dir):
    """On CPU ``auto`` keeps the checkpoint's float32; ``--dtype bfloat16`` loads the weights,
    allocates the KV cache and runs the forward in bfloat16."""
    for flags, dtype in (({}, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16)):
        runner = llm(model_dir, max_total_tokens=256, **flags).engine.runner
        assert {p.dtype for p in runner.model.parameters()} == {dtype}
        assert {t.dtype for layer in runner.kv_caches for t in layer} == {dtype}
        assert runner.startup_report()["kv_cache_dtype"] == str(dtype).removeprefix("torch.")
    out = llm(model_dir, dtype="bfloat16").generate([[5, 17, 42]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 6


def test_random_seed_seeds_requests_without_their_own_seed(model_dir):
    prompts = random_prompts((6, 9), VOCAB)
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def draw(**flags):
        return [o.outputs[0].token_ids for o in llm(model_dir, **flags).generate(prompts, sampled)]

    seven = draw(random_seed=7)
    assert draw(random_seed=7) == seven
    assert draw(random_seed=8) != seven


def test_tokenizer_path_loads_the_tokenizer_from_another_directory(model_dir, tokenizer_dir):
    assert llm(model_dir).tokenizer is None  # the checkpoint has none
    model = llm(model_dir, tokenizer_path=tokenizer_dir)
    assert model.tokenizer is not None
    (out,) = model.generate("w5 w17 w42", GREEDY)
    assert out.prompt_token_ids == [5, 17, 42]
    completion = out.outputs[0]
    assert word_token_ids(completion.text) == completion.token_ids


def test_skip_tokenizer_init_loads_no_tokenizer(model_dir, tokenizer_dir, tmp_path):
    """A checkpoint shipping its tokenizer: by default text prompts work and completions carry
    text; with ``--skip-tokenizer-init`` there is no tokenizer, text prompts are refused and
    completions carry token ids only."""
    import shutil

    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    with_tokenizer = llm(str(tmp_path))
    assert with_tokenizer.generate("w5 w17 w42", GREEDY)[0].outputs[0].text
    skipped = llm(str(tmp_path), skip_tokenizer_init=True)
    assert skipped.tokenizer is None
    with pytest.raises(ValueError, match="text needs a tokenizer.*skip_tokenizer_init"):
        skipped.generate("w5 w17 w42", GREEDY)
    completion = skipped.generate([[5, 17, 42]], GREEDY)[0].outputs[0]
    assert completion.text == "" and len(completion.token_ids) == 6


def test_device_cpu_runs_an_engine_resolved_for_a_gpu_platform_on_the_cpu(model_dir):
    """For the H200 preset resolution picks ``cuda``, where the runner would run flashinfer;
    ``--device cpu`` runs the engine on the CPU with the torch references."""
    everything = lambda module: True  # noqa: E731 - the CUDA libraries' presence, as a predicate
    config, _ = resolved(model_dir, "h200")
    assert config.device == "cuda"
    assert kernel_backends_for(config, torch.bfloat16, moe_model=False, available=everything).attention == "flashinfer"
    model = LLM(model_dir, platform=preset("h200"), device="cpu")
    runner = model.engine.runner
    assert runner.device == torch.device("cpu")
    assert set(runner.startup_report()["kernel_backends"].values()) == {"torch"}
    assert len(model.generate([[5, 17, 42]], GREEDY)[0].outputs[0].token_ids) == 6


# -- MoE: the expert-load recorder --------------------------------------------------------------


def test_expert_distribution_recorder_buffer_size_is_the_window_of_forward_passes(tmp_path):
    """Three prompts decoded together to the same length: with a window of one forward pass
    the recorder holds only the last decode step (3 tokens x top-2 per sparse layer); the
    default window (1000 passes) holds every token the layers processed."""
    save_tiny_qwen3_moe(tmp_path)
    prompts = random_prompts((5, 17, 40), VOCAB)
    loads = {}
    for window in (None, 1):
        flags = {"expert_distribution_recorder_mode": "stat"}
        if window is not None:
            flags["expert_distribution_recorder_buffer_size"] = window
        model = llm(str(tmp_path), max_total_tokens=1024, **flags)
        model.generate(prompts, GREEDY)
        loads[window] = model.engine.runner.expert_load()
    processed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    assert (loads[None]["window"], loads[1]["window"]) == (1000, 1)
    assert [sum(row) for row in loads[None]["per_layer"]] == [processed * 2] * 2
    assert [sum(row) for row in loads[1]["per_layer"]] == [3 * 2] * 2


# -- decisions a GPU runner makes, on their functions -----------------------------------------------

CUDA_GRAPH_INPUTS = dict(
    device=torch.device("cuda"), attention_backend="flashinfer", collectives=None, elastic=False, recording=False,
    moe_on_torch=False, max_num_seqs=256,
)  # fmt: skip


def graph_sizes(model_dir, **flags):
    return decode_graph_sizes(resolved(model_dir, "h200", **flags)[0], **CUDA_GRAPH_INPUTS)


def test_disable_decode_cuda_graph_turns_decode_graphs_off(model_dir):
    sizes, reason = graph_sizes(model_dir)
    assert reason is None and sizes[:4] == (1, 2, 4, 8) and sizes[-1] == 256
    off = graph_sizes(model_dir, disable_decode_cuda_graph=True)
    assert off == ((), "decode CUDA graphs are disabled by the configuration")


def test_cuda_graph_config_sets_the_decode_graph_sizes(model_dir):
    assert graph_sizes(model_dir, cuda_graph_config={"decode": {"bs": [1, 2, 6]}}) == ((1, 2, 6), None)
    assert graph_sizes(model_dir, cuda_graph_config={"decode": {"max_bs": 8}}) == ((1, 2, 4, 8), None)
    sizes, reason = graph_sizes(model_dir, cuda_graph_config={"decode": {"backend": "disabled"}})
    assert sizes == () and "disabled by the configuration" in reason


def test_split_attention_backend_fields_choose_the_attention_kernels(model_dir):
    """On CUDA in bfloat16 the H200 default (fa3) runs flashinfer; both split fields set to
    torch_native run the torch reference; one split field alone that disagrees with the
    resolved ``--attention-backend`` stops the start, naming it."""
    everything = lambda module: True  # noqa: E731 - the CUDA libraries' presence, as a predicate

    def attention(**flags):
        config = resolved(model_dir, "h200", **flags)[0]
        return kernel_backends_for(config, torch.bfloat16, moe_model=False, available=everything).attention

    assert attention() == "flashinfer"
    assert attention(prefill_attention_backend="torch_native", decode_attention_backend="torch_native") == "torch"
    with pytest.raises(ValueError, match="decode_attention_backend='torch_native' runs on the torch reference"):
        attention(decode_attention_backend="torch_native")
    with pytest.raises(ValueError, match="prefill_attention_backend='torch_native' runs on the torch reference"):
        attention(prefill_attention_backend="torch_native")


def test_mem_fraction_static_sizes_a_cuda_kv_pool(model_dir, monkeypatch):
    """The runner's CUDA pool size (no ``--max-total-tokens``): the static share of device
    memory minus what is in use, per KV byte. Probed here on a fake 10 GiB device with 2 GiB
    in use: the default share 0.88 leaves 6.8 GiB, ``--mem-fraction-static 0.5`` 3 GiB, and
    0.1 leaves nothing (an error naming the flag)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 10 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    per_token = 4096

    def pool_tokens(**flags) -> int:
        runner = ModelRunner(*resolved(model_dir, **flags))
        runner.device = torch.device("cuda")  # NOTE: only the sizing reads it, after start-up
        return runner._kv_cache_tokens(per_token)

    assert pool_tokens() == (int(10 * 2**30 * 0.88) - 2 * 2**30) // per_token
    assert pool_tokens(mem_fraction_static=0.5) == 3 * 2**30 // per_token
    with pytest.raises(ValueError, match="mem_fraction_static=0.1 leaves no room for the KV cache"):
        pool_tokens(mem_fraction_static=0.1)


def test_disable_overlap_schedule_turns_overlap_scheduling_off(model_dir):
    """An engine resolved for a GPU (H200 preset) overlaps its steps by default: each
    ``step()`` returns the tokens of the step before, so the first returns none. With
    ``--disable-overlap-schedule`` each step returns its own tokens. (The runner here is the
    CPU runner, which can launch steps ahead like the CUDA one.)"""
    cpu_config, source = resolved(model_dir, max_total_tokens=512)
    runner = ModelRunner(cpu_config, source)
    first_steps, tokens = {}, {}
    for flags in ({}, {"disable_overlap_schedule": True}):
        gpu_config, _ = resolved(model_dir, "h200", max_total_tokens=512, **flags)
        engine = LLMEngine(gpu_config, source, runner=runner)
        assert engine.overlap is not bool(flags)
        rid = engine.add_request([5, 17, 42, 9], GREEDY)
        first_steps[bool(flags)] = engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        tokens[bool(flags)] = engine.pop_output(rid).outputs[0].token_ids
    assert first_steps[False] == []
    assert [len(d.token_ids) for d in first_steps[True]] == [1]
    assert tokens[True] == tokens[False]


# -- the bounds on a worker group's waits (a tensor-parallel group on the session's Ray) ----------


def _stopped_rank_step(ray_cluster, model_dir, **bounds):
    """A TP=2 engine (two Ray worker actors) with one prefill behind it, rank 1's process
    stopped (SIGSTOP), then one step: ``(seconds it took, the error it raised)``. Rank 0 waits
    in the step's first collective for rank 1; the driver waits for both ranks' answers."""
    import os
    import signal
    import time

    ray = pytest.importorskip("ray")
    config, source = resolved(model_dir, tp_size=2, max_total_tokens=512, **bounds)
    engine = LLMEngine(config, source)
    rank1 = engine.runner.group.actors[1]
    pid = ray.get(rank1.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    try:
        engine.add_request([5, 17, 42, 9], GREEDY)
        engine.step()
        engine.add_request([7, 3, 11], GREEDY)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        deltas = engine.step()
        elapsed = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.runner.shutdown()
    errors = {d.error for d in deltas}
    assert len(errors) == 1 and all(d.finish_reason == "error" for d in deltas), deltas
    return elapsed, errors.pop()


def test_watchdog_timeout_bounds_the_wait_for_a_stuck_rank(ray_cluster, model_dir):
    """A rank that stops answering fails the step after ``--watchdog-timeout`` 20 s (the
    default 300 s would hold the step that long): every in-flight request ends with an error
    naming the rank. ``--dist-timeout`` is above it, so rank 0's collective still waits then.
    (The bound also covers the group's start, hence not less.)"""
    elapsed, error = _stopped_rank_step(ray_cluster, model_dir, watchdog_timeout=20, dist_timeout=120)
    assert 20 <= elapsed < 20 + 10, elapsed
    assert "within 20.0s" in error and "pending" in error, error


def test_dist_timeout_bounds_a_collective_waiting_for_a_stuck_rank(ray_cluster, model_dir):
    """Rank 0's collective gives up after ``--dist-timeout`` 2 s and rank 0 raises, long
    before the 60 s step bound: the step fails with rank 0's collective error."""
    elapsed, error = _stopped_rank_step(ray_cluster, model_dir, watchdog_timeout=60, dist_timeout=2)
    assert 2 <= elapsed < 2 + 10, elapsed
    assert "rank 0" in error and "timed out" in error, error
