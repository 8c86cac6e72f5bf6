"""Overlap scheduling (cluster/engine/overlap.py) on the CPU: the engine launches step N+1
before it reads step N's tokens. On CPU nothing actually overlaps, but every piece of the
bookkeeping runs: placeholders, the device-side feed of input ids, late stop checks, wasted
rows of requests that finished, aborts, preemption, the fallbacks. The oracle is the same
engine without overlap: greedy and seeded outputs must be identical, and no KV block may leak."""

import pytest

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.overlap import PENDING_TOKEN
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.tiny_models import save_tiny_llama

VOCAB = 256
PROMPTS = [[11, 42, 7, 99, 3, 250, 17, 64], [5, 6, 7], list(range(40, 75)), [200, 1, 2, 3, 4]]


class LetterTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-overlap")
    save_tiny_llama(path, vocab_size=VOCAB)
    return path


def make_engine(path, overlap, **flags):
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path), **flags)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    return LLMEngine(config, source, LetterTokenizer(), overlap=overlap)


def run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.pop_output(i) for i in ids]
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def count_feeds(engine):
    """Count the launches that got a previous step's feed (the overlapped ones)."""
    counts = {"fed": 0, "launches": 0}
    launch = engine.runner.launch

    def counted(step, rows, feed=None):
        counts["launches"] += 1
        counts["fed"] += feed is not None
        return launch(step, rows, feed)

    engine.runner.launch = counted
    return counts


def assert_no_leak(engine):
    pool = engine.scheduler.pool
    engine.scheduler.check_invariants()
    assert engine._inflight is None
    assert pool.num_used_blocks == 0, pool.num_used_blocks
    pool.check_invariants()


def test_overlap_is_off_on_cpu_unless_asked(model_path):
    assert make_engine(model_path, None).overlap is False
    assert make_engine(model_path, True).overlap is True


MIXED = [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, n=2),
]


def test_outputs_equal_the_engine_without_overlap(model_path):
    want = run(make_engine(model_path, False), PROMPTS, MIXED)
    engine = make_engine(model_path, True)
    counts = count_feeds(engine)
    assert run(engine, PROMPTS, MIXED) == want
    # every launch after the first overlapped the one before (all prefills fit the first step)
    assert counts["fed"] == counts["launches"] - 1 > 10, counts
    assert_no_leak(engine)


def test_stop_conditions_seen_one_step_late_drop_the_extra_token(model_path):
    base = run(make_engine(model_path, False), PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens, text = base[0][0][0], base[0][0][1]
    stops = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[4]]),
        SamplingParams(temperature=0, max_tokens=20, stop=text[6:8]),
    ]
    for params in stops:
        want = run(make_engine(model_path, False), PROMPTS[:1], params)
        engine = make_engine(model_path, True)
        assert run(engine, PROMPTS[:1], params) == want
        assert want[0][0][2] == "stop" and len(want[0][0][0]) < 20
        assert_no_leak(engine)


def test_each_step_returns_the_tokens_of_the_step_before(model_path):
    engine = make_engine(model_path, True)
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token is still "on the device"
    request = engine.scheduler.get(rid)
    assert request.all_token_ids[-1] == PENDING_TOKEN
    first = engine.step()  # launches the first decode, then resolves the prefill's token
    assert [d.token_ids for d in first] == [[request.all_token_ids[len(PROMPTS[0])]]]
    assert PENDING_TOKEN not in request.all_token_ids[:-1] and request.all_token_ids[-1] == PENDING_TOKEN
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.finish_reason for d in deltas] == [None, "length"]
    assert engine.pop_output(rid).outputs[0].token_ids == request.output_token_ids
    assert_no_leak(engine)


def test_a_stream_ending_at_max_tokens_computes_no_extra_step(model_path):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    serial, overlapped = make_engine(model_path, False), make_engine(model_path, True)
    counts = count_feeds(overlapped)
    serial_launches = {"n": 0}
    execute = serial.runner.execute

    def counted(step, rows):
        serial_launches["n"] += 1
        return execute(step, rows)

    serial.runner.execute = counted
    assert run(overlapped, PROMPTS[:1], params) == run(serial, PROMPTS[:1], params)
    # one prefill and six decodes either way: the last token resolves before a 7th decode
    assert counts["launches"] == serial_launches["n"] == 7, (counts, serial_launches)
    assert_no_leak(overlapped)


def test_abort_while_a_step_is_in_flight(model_path):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run(make_engine(model_path, False), PROMPTS[:1], params)
    engine = make_engine(model_path, True)
    keep = engine.add_request(PROMPTS[0], params)
    drop = engine.add_request(PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    assert engine.abort(drop)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pop_output(drop).outputs[0].finish_reason == "abort"
    out = engine.pop_output(keep).outputs[0]
    assert [(out.token_ids, out.text, out.finish_reason, out.stop_reason)] == want[0]
    assert_no_leak(engine)


def test_preemption_under_a_tiny_pool_keeps_the_outputs(model_path):
    prompts = [list(range(i, i + 20)) for i in range(1, 80, 13)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = run(make_engine(model_path, False, max_total_tokens=128), prompts, params)
    engine = make_engine(model_path, True, max_total_tokens=128)
    counts = count_feeds(engine)
    assert run(engine, prompts, params) == want
    assert counts["fed"] > counts["launches"] // 2, counts
    assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)


def test_preemption_with_a_host_tier_loads_blocks_back_and_keeps_the_outputs(model_path):
    """The same, with the host tier (--enable-hierarchical-cache): a victim's offload is queued
    while the step before it (which may still write the victim's blocks) is in flight."""
    prompts = [list(range(i, i + 20)) for i in range(1, 80, 13)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = run(make_engine(model_path, False, max_total_tokens=128), prompts, params)
    engine = make_engine(model_path, True, max_total_tokens=128, enable_hierarchical_cache=True)
    counts = count_feeds(engine)
    assert run(engine, prompts, params) == want
    assert counts["fed"] > counts["launches"] // 2, counts
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and stats["host_kv_loaded_blocks"] > 0
    assert_no_leak(engine)


def test_penalties_fall_back_to_resolving_first(model_path):
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    want = run(make_engine(model_path, False), PROMPTS, params)
    engine = make_engine(model_path, True)
    counts = count_feeds(engine)
    assert run(engine, PROMPTS, params) == want
    assert counts["fed"] == 0 and counts["launches"] > 10, counts
    assert_no_leak(engine)


def test_a_pending_token_without_its_feed_is_refused(model_path):
    engine = make_engine(model_path, True)
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    step = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="pending token"):
        engine.runner.prepare_inputs(step)


def test_a_runner_failure_in_flight_fails_every_request(model_path, monkeypatch):
    engine = make_engine(model_path, True)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in PROMPTS[:2]]
    engine.step()
    engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", broken)
    deltas = engine.step()
    assert {d.finish_reason for d in deltas} >= {"error"}
    assert engine.dead is not None and not engine.has_unfinished_requests()
    for rid in ids:
        out = engine.pop_output(rid)
        assert out.outputs[0].finish_reason == "error" and "device lost" in out.error
    assert engine._inflight is None
    assert engine.scheduler.pool.num_used_blocks == 0


def test_overlap_needs_a_runner_that_launches_ahead(model_path):
    engine = make_engine(model_path, False)
    with pytest.raises(ValueError, match="overlap=True needs a runner that can launch steps ahead; _NoLaunch cannot"):
        LLMEngine(engine.config, engine.source, runner=_NoLaunch(engine.runner), overlap=True)


class _NoLaunch:
    """A runner face without ``launch`` (as GroupRunner)."""

    def __init__(self, runner):
        self.kv_layout, self.vocab_size = runner.kv_layout, runner.vocab_size


def test_seeded_rows_sample_the_same_tokens(model_path):
    params = SamplingParams(temperature=1.0, top_k=20, seed=123, max_tokens=10, ignore_eos=True)
    want = run(make_engine(model_path, False), PROMPTS, params)
    assert run(make_engine(model_path, True), PROMPTS, params) == want
