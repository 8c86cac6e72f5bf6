"""LLMEngine: stop conditions, n > 1, seeds, logprobs, abort, streaming and the
incremental detokenizer, on a tiny random Llama (HF is the oracle for logprobs)
with fake tokenizers whose text is easy to predict."""

import pytest
import torch

from flotilla.cluster.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.margins import ENGINE_MIN_LEAD
from helpers.tiny_models import save_tiny_llama

VOCAB = 256


class LetterTokenizer:
    """Token ``t`` is the letter ``chr(97 + t % 26)``; no special tokens."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


class ByteTokenizer:
    """Token ``t`` is the byte ``t``: multi-byte characters span several tokens."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path, vocab_size=VOCAB)
    return path, model


def make_engine(path, tokenizer=LetterTokenizer(), **flags):
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path), **flags)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    return LLMEngine(config, source, tokenizer)


def run(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_output(i) for i in ids]


PROMPT = [11, 42, 7, 99, 3, 250, 17, 64]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(model_dir):
    (out,) = run(make_engine(model_dir[0]), [PROMPT], GREEDY)
    return out.outputs[0]


def test_text_is_the_decoded_tokens(baseline):
    assert baseline.text == LetterTokenizer().decode(baseline.token_ids)
    assert len(baseline.token_ids) == 24 and baseline.finish_reason == "length"


def test_stop_string_truncates_the_text_and_the_generation(model_dir, baseline):
    stop = baseline.text[10:13]
    cut = baseline.text.find(stop)
    (out,) = run(make_engine(model_dir[0]), [PROMPT], SamplingParams(temperature=0, max_tokens=24, stop=stop))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (baseline.text[:cut], "stop", stop)
    assert c.token_ids == baseline.token_ids[: cut + len(stop)]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop, "#"], include_stop_str_in_output=True)
    (out,) = run(make_engine(model_dir[0]), [PROMPT], params)
    assert out.outputs[0].text == baseline.text[: cut + len(stop)]


def test_stop_token_id_ends_the_completion_and_keeps_the_token(model_dir, baseline):
    stop_id = baseline.token_ids[5]
    cut = baseline.token_ids.index(stop_id)
    (out,) = run(make_engine(model_dir[0]), [PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == baseline.token_ids[: cut + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == baseline.text[:cut]  # the stop token's text is not shown


def test_eos_stops_unless_ignore_eos(model_dir, baseline):
    engine = make_engine(model_dir[0])
    eos = baseline.token_ids[3]
    engine.eos_token_ids = frozenset({eos})
    cut = baseline.token_ids.index(eos)
    (stopped,) = run(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=24))
    assert stopped.outputs[0].token_ids == baseline.token_ids[: cut + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    (ignored,) = run(engine, [PROMPT], GREEDY)
    assert ignored.outputs[0].token_ids == baseline.token_ids


def test_max_tokens_none_runs_to_the_context_length(model_dir):
    (out,) = run(make_engine(model_dir[0]), [[5] * 250], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(model_dir):
    params = SamplingParams(temperature=1.5, max_tokens=16, seed=7, ignore_eos=True)
    (alone,) = run(make_engine(model_dir[0]), [PROMPT], params)
    engine = make_engine(model_dir[0])
    other = engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=20))
    crowded = run(engine, [[9] * 30, PROMPT], params)[1]
    engine.pop_output(other)
    assert crowded.outputs[0].token_ids == alone.outputs[0].token_ids
    (different,) = run(make_engine(model_dir[0]), [PROMPT], SamplingParams(temperature=1.5, max_tokens=16, seed=8))
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_completions_share_the_prompt_and_differ(model_dir):
    engine = make_engine(model_dir[0])
    (out,) = run(engine, [PROMPT * 4], SamplingParams(n=3, temperature=1.5, max_tokens=12, seed=1, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.finished and engine.scheduler.pool.num_used_blocks == 0


def test_logprobs_equal_hf_log_softmax_of_raw_logits(model_dir):
    path, hf = model_dir
    (out,) = run(make_engine(path), [PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))
    c = out.outputs[0]
    hf.generation_config.eos_token_id = None  # ignore_eos
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    expected = torch.log_softmax(torch.cat(ref.logits).float(), dim=-1)  # [8, V]
    assert c.token_ids == ref.sequences[0, len(PROMPT):].tolist()
    for step, token, row in zip(c.logprobs, c.token_ids, expected):
        top = row.topk(3)
        assert list(step)[:3] == top.indices.tolist()
        # fp32, same weights: tolerance covers summation-order differences only.
        assert step[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [step[t].rank for t in top.indices.tolist()] == [1, 2, 3]
    assert c.cumulative_logprob == pytest.approx(sum(s[t].logprob for s, t in zip(c.logprobs, c.token_ids)))


def test_abort_frees_blocks_at_once_and_others_continue(model_dir, baseline):
    engine = make_engine(model_dir[0])
    victim = engine.add_request([4] * 40, SamplingParams(temperature=0, max_tokens=50))
    keeper = engine.add_request(PROMPT, GREEDY)
    for _ in range(3):
        engine.step()
    used = engine.scheduler.pool.num_used_blocks
    assert engine.abort(victim)
    assert engine.scheduler.pool.num_used_blocks == used - 3  # the victim's 43 tokens held 3 blocks
    engine.scheduler.check_invariants()
    assert not engine.abort(victim)
    deltas = engine.step()
    assert any(d.request_id == victim and d.finish_reason == "abort" for d in deltas)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pop_output(victim).outputs[0].finish_reason == "abort"
    assert engine.pop_output(keeper).outputs[0].token_ids == baseline.token_ids
    assert engine.scheduler.pool.num_used_blocks == 0


def test_stream_yields_deltas_that_add_up_and_hold_back_stop_prefixes(model_dir, baseline):
    engine = make_engine(model_dir[0])
    stop = baseline.text[10:13]
    other = engine.add_request(PROMPT[:4], GREEDY, stream=True)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=stop), stream=True)
    deltas = list(engine.stream(rid))
    assert "".join(d.text for d in deltas) == engine.get_output(rid).outputs[0].text
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])
    # The other streamed request lost nothing while this one was streamed.
    rest = list(engine.stream(other))
    assert sum(len(d.token_ids) for d in rest) == 24
    assert "".join(d.text for d in rest) == engine.pop_output(other).outputs[0].text


TOP = 8


def _penalized_lead(step, chosen: int, counts: dict[int, int], penalty: float) -> float:
    """A lower bound on how far the frequency-penalized greedy choice ``chosen`` leads every
    other token, from one step's raw log-probs (the ``TOP`` best, and the chosen one's): a
    token outside them is below the ``TOP``-th before its penalty, which only lowers it."""
    penalized = {t: e.logprob - penalty * counts.get(t, 0) for t, e in step.items()}
    floor = min(e.logprob for e in step.values() if e.rank <= TOP)
    return penalized[chosen] - max([v for t, v in penalized.items() if t != chosen] + [floor])


def _stream_tokens_and_text(deltas):
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


@pytest.mark.parametrize("tokenizer", [LetterTokenizer(), ByteTokenizer()], ids=["letters", "bytes"])
@pytest.mark.parametrize("share", [0.0, 0.5, 0.9])
def test_a_resumed_request_streams_what_the_undisturbed_one_would_have(model_dir, tokenizer, share):
    """A migrated request (resumed_token_ids: what another engine streamed before it stopped)
    goes on exactly where the stream was cut: the same next tokens (the frequency penalty
    counts the resumed tokens as generated ones), the same text (held-back stop prefixes and split
    multi-byte characters included), the same stop and the same finish."""
    engine = make_engine(model_dir[0], tokenizer)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5)
    (free,) = run(engine, [PROMPT], plain)
    # A stop string late in the text: its prefixes are held back at every earlier step.
    text = free.outputs[0].text
    stop = text[len(text) * 3 // 4 :][:2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, stop=stop, logprobs=TOP)
    whole = list(engine.stream(engine.add_request(PROMPT, params, stream=True)))
    assert len(whole) >= 4 and whole[-1].finish_reason == "stop"
    # NOTE: the resumed tokens are computed in one prefill, not step by step: every greedy
    # choice must lead by more than the two computations can differ (helpers.margins).
    counts: dict[int, int] = {}
    for delta in whole:
        (chosen,), (step,) = delta.token_ids, delta.logprobs
        assert _penalized_lead(step, chosen, counts, 1.5) > ENGINE_MIN_LEAD, f"greedy near-tie at {delta}"
        counts[chosen] = counts.get(chosen, 0) + 1
    cut = max(1, int(share * len(whole)))  # NOTE: one token per delta; at least one is resumed
    streamed_tokens, streamed_text = _stream_tokens_and_text(whole[:cut])
    rid = engine.add_request(PROMPT, params, stream=True, resumed_token_ids=streamed_tokens)
    rest = list(engine.stream(rid))
    assert _stream_tokens_and_text(rest) == _stream_tokens_and_text(whole[cut:])
    assert streamed_text + _stream_tokens_and_text(rest)[1] == _stream_tokens_and_text(whole)[1]
    assert (rest[-1].finish_reason, rest[-1].stop_reason) == (whole[-1].finish_reason, whole[-1].stop_reason)
    out = engine.pop_output(rid).outputs[0]
    assert out.token_ids == _stream_tokens_and_text(whole)[0]
    assert engine.scheduler.pool.num_used_blocks == 0


def test_resumed_tokens_are_refused_where_they_cannot_resume(model_dir):
    engine = make_engine(model_dir[0])
    with pytest.raises(ValueError, match=r"resumed_token_ids: only a generating request with n=1 resumes \(got n=2"):
        engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=4), resumed_token_ids=[1])
    with pytest.raises(ValueError, match="resumed_token_ids: 4 tokens already reach max_tokens=4"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), resumed_token_ids=[1, 2, 3, 4])
    assert not engine.has_unfinished_requests()


def test_iter_outputs_runs_everything_to_completion(model_dir):
    engine = make_engine(model_dir[0])
    ids = [engine.add_request(PROMPT[: n + 1], SamplingParams(temperature=0, max_tokens=n + 2)) for n in range(3)]
    counts = {}
    for delta in engine.iter_outputs():
        counts[delta.request_id] = counts.get(delta.request_id, 0) + len(delta.token_ids)
    assert counts == {ids[0]: 2, ids[1]: 3, ids[2]: 4}


def test_duplicate_request_ids_and_bad_prompts_are_rejected(model_dir):
    engine = make_engine(model_dir[0])
    engine.add_request(PROMPT, GREEDY, request_id="a")
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        engine.add_request(PROMPT, GREEDY, request_id="a")
    with pytest.raises(ValueError, match="prompt_token_ids: token id 256 is outside"):
        engine.add_request([1, 256], GREEDY)
    small_pool = make_engine(model_dir[0], max_total_tokens=64)
    with pytest.raises(ValueError, match=r"max_tokens: the request needs 108 tokens .* more than the 64"):
        small_pool.add_request(PROMPT, SamplingParams(max_tokens=100))
    assert not small_pool.has_unfinished_requests()


def test_detokenizer_never_splits_a_multibyte_character():
    text = "héllo €𝄞 ok"
    detok = IncrementalDetokenizer(ByteTokenizer(), prompt_token_ids=list(b"hi "))
    pieces = [detok.add(b) for b in text.encode()]
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # held back until the second byte arrives


def test_detokenizer_keeps_context_dependent_spaces():
    class SpaceTokenizer:
        # Like SentencePiece: a leading "_" is a space except at the very start.
        def decode(self, ids, skip_special_tokens=True):
            return "".join(" " + chr(97 + t) for t in ids).lstrip(" ")

    detok = IncrementalDetokenizer(SpaceTokenizer(), prompt_token_ids=[0, 1])
    assert [detok.add(t) for t in (2, 3)] == [" c", " d"]


def test_find_stop_string_looks_only_at_new_text_and_picks_the_earliest():
    assert find_stop_string("abcdef", 3, ["ef", "cd"]) == ("cd", 2)
    assert find_stop_string("abcdef", 2, ["cd", "ef"]) == ("ef", 4)
    assert find_stop_string("abcdef", 1, ["ab"]) is None
    assert find_stop_string("xxSTOP", 1, ["STOP"]) == ("STOP", 2)


def test_max_running_requests_is_capped_at_the_step_budget():
    from types import SimpleNamespace

    from flotilla.cluster.engine.llm_engine import scheduler_config_for
    from flotilla.cluster.engine.model_runner import KVCacheLayout

    from flotilla.resolution.fields import DEFAULTS

    kv = KVCacheLayout(num_blocks=64, block_size=16, bytes_per_token=1)
    # NOTE: every other server field at its default, as a resolved config holds it.
    config = SimpleNamespace(**{**DEFAULTS, "chunked_prefill_size": 128, "max_prefill_tokens": 16384, "max_running_requests": 512})
    assert scheduler_config_for(config, kv).max_num_seqs == 128
    config.max_running_requests = 8
    assert scheduler_config_for(config, kv).max_num_seqs == 8
