"""Constrained decoding in the engine (SmolLM2-135M-Instruct, CPU): each grammar backend's
output matches its constraint, constrained and free requests share steps without the free
ones' tokens changing, a constraint that does not compile is a ValueError naming its
parameter, ``--grammar-backend none`` refuses constrained requests, the reasoning gate, the
bitmask layout, and overlap scheduling waiting for a constrained request's token."""

import json
import re

import jsonschema
import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.grammar import GrammarState
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampler import SamplingRow, apply_token_bitmasks, unpack_bitmasks
from flotilla.cluster.engine.sampling_params import GuidedDecoding
from flotilla.resolution.config import ResolvedConfig, thaw

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and favourite colour."}]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_total_tokens=4096)
    yield engine
    engine.shutdown()


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


def engine_with(llm, **fields) -> LLMEngine:
    """An engine over ``llm``'s runner (no second model load) whose config sets ``fields``."""
    config = ResolvedConfig.build({**thaw(llm.engine.config.config), **fields}, llm.engine.config.env, ())
    return LLMEngine(config, llm.engine.source, llm.tokenizer, runner=llm.engine.runner)


def run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]):
    """Each prompt's completions (chat-templated) through ``engine``, all in one batch."""
    tokenizer = engine.tokenizer
    ids = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for p in prompts
    ]
    added = [engine.add_request(i, p) for i, p in zip(ids, params)]
    for _ in engine.iter_outputs():
        pass
    return [engine.pop_output(r).outputs for r in added]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_each_backend_keeps_sampled_output_inside_the_constraint(llm, backend):
    engine = engine_with(llm, grammar_backend=backend)
    assert engine.grammars.name == backend
    pattern = r"(yes|no)\. [A-Z][a-z]{2,8}\."
    constraints = [
        SamplingParams(temperature=0.9, max_tokens=50, seed=7, n=2, guided=GuidedDecoding("json_schema", json.dumps(PERSON))),
        SamplingParams(temperature=0.9, seed=3, max_tokens=16, guided=GuidedDecoding("regex", pattern, param="regex")),
        SamplingParams(temperature=0, max_tokens=10, guided=GuidedDecoding("ebnf", 'root ::= "The answer is " [0-9]+ "."', param="ebnf")),
        SamplingParams(temperature=0.7, seed=5, max_tokens=50, guided=GuidedDecoding("json_object")),
    ]
    people, answer, number, anything = run(engine, [ASK[0]["content"], "Is the sea blue?", "What is 2 + 2?", ASK[0]["content"]], constraints)
    for person in people:
        assert person.finish_reason == "stop"
        jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(pattern, answer[0].text), answer[0].text
    assert re.fullmatch(r"The answer is [0-9]+\.", number[0].text), number[0].text
    assert isinstance(json.loads(anything[0].text), dict)


def test_free_requests_keep_their_greedy_tokens_beside_constrained_ones(llm):
    """16 requests in one batch, every other one constrained: the free ones' tokens equal
    their tokens when they run alone (the mask touches only its own row: the free rows'
    logits are the same computation whatever shares the batch, up to batch-size dependent
    float32 reduction order, far below SmolLM2's greedy leads on these chat prompts)."""
    questions = [f"Tell me one fact about the number {i}." for i in range(8)]
    free = SamplingParams(temperature=0, max_tokens=12)
    constrained = SamplingParams(temperature=0, max_tokens=40, guided=GuidedDecoding("json_schema", json.dumps(PERSON)))
    alone = texts(llm.chat([[{"role": "user", "content": q}] for q in questions], free))
    conversations, params = [], []
    for q in questions:
        conversations += [[{"role": "user", "content": q}], ASK]
        params += [free, constrained]
    mixed = texts(llm.chat(conversations, params))
    assert mixed[0::2] == alone
    for text in mixed[1::2]:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_constraint_cut_by_max_tokens_ends_with_length(llm):
    out = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=5, guided=GuidedDecoding("json_schema", json.dumps(PERSON))))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(completion.text)


def test_a_constraint_that_does_not_compile_names_its_parameter_and_queues_nothing(llm):
    bad = GuidedDecoding("regex", "(unclosed", param="regex")
    with pytest.raises(ValueError, match=r"^regex: the regular expression does not compile: .*parenthesis"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, guided=bad))
    schema = GuidedDecoding("json_schema", json.dumps({"type": "objec"}), param="response_format")
    with pytest.raises(ValueError, match=r"^response_format: the JSON schema does not compile: .*objec"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, n=3, guided=schema))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["hi"], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_grammar_backend_none_refuses_constrained_requests(llm):
    engine = engine_with(llm, grammar_backend="none")
    assert engine.grammars is None
    with pytest.raises(ValueError, match=r"^response_format: .*--grammar-backend none"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, guided=GuidedDecoding("json_object")))
    assert not engine.has_unfinished_requests()
    assert run(engine, ["hi"], [SamplingParams(max_tokens=2)])[0][0].finish_reason == "length"


def test_disable_any_whitespace_gives_canonical_json(llm):
    guided = SamplingParams(temperature=0, max_tokens=50, guided=GuidedDecoding("json_schema", json.dumps(PERSON)))
    spaced, compact = (run(engine_with(llm, constrained_json_disable_any_whitespace=flag), [ASK[0]["content"]], [guided])[0][0].text for flag in (False, True))
    assert json.loads(spaced) and any(c.isspace() for c in spaced), spaced
    # NOTE: xgrammar's whitespace-free JSON is the canonical form: ", " and ": " separators only.
    assert compact == json.dumps(json.loads(compact)), compact
    jsonschema.validate(json.loads(compact), PERSON)


def test_compiled_constraints_are_cached(llm):
    guided = GuidedDecoding("json_schema", json.dumps(PERSON))
    first = llm.engine.grammars.compile(guided)
    assert llm.engine.grammars.compile(GuidedDecoding("json_schema", json.dumps(PERSON))) is first
    assert llm.engine.grammars.compile(GuidedDecoding("json_schema", json.dumps(PERSON), strict=False)) is not first


def test_the_reasoning_gate_constrains_only_after_the_section_ends(llm):
    """The tags are ordinary multi-token strings here (SmolLM2 has no think tokens)."""
    tokenizer, grammars = llm.tokenizer, llm.engine.grammars
    start = tuple(tokenizer.encode("<think>", add_special_tokens=False))
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert len(start) > 1 and len(end) > 1
    guided = GuidedDecoding("regex", "ok", reasoning_start=start, reasoning_end=end)
    ok = tokenizer.encode("ok", add_special_tokens=False)

    def allowed(state):
        mask = state.next_bitmask()
        return None if mask is None else set(torch.nonzero(unpack_bitmasks(mask[None], llm.engine.vocab_size)[0]).flatten().tolist())

    opened: GrammarState = grammars.state_for(guided)
    first = allowed(opened)
    assert start[0] in first and ok[0] in first and len(first) < 10  # the grammar's tokens or the start tag's
    for token in start:
        assert opened.accept(token)
    assert opened.phase == "reasoning" and allowed(opened) is None
    for token in tokenizer.encode("free text ", add_special_tokens=False) + list(end):
        assert opened.accept(token)
    assert opened.active and ok[0] in allowed(opened) and start[0] not in allowed(opened)

    direct = grammars.state_for(guided)
    assert direct.accept(ok[0]) and direct.active  # the output did not open a section
    in_prompt = grammars.state_for(GuidedDecoding("regex", "ok", reasoning_start=start, reasoning_end=end, starts_in_reasoning=True))
    assert allowed(in_prompt) is None


def test_bitmask_layout_and_masking_touch_only_masked_rows():
    vocab = 70
    allowed = [3, 31, 32, 69]
    packed = torch.zeros(3, dtype=torch.int32)
    for t in allowed:
        word, bit = divmod(t, 32)
        packed[word] |= -(1 << 31) if bit == 31 else 1 << bit
    assert torch.nonzero(unpack_bitmasks(packed[None], vocab)[0]).flatten().tolist() == allowed
    logits = torch.randn(2, vocab)
    rows = [SamplingRow(SamplingParams()), SamplingRow(SamplingParams(), token_bitmask=packed)]
    masked = apply_token_bitmasks(logits, rows)
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed
    assert torch.equal(masked[1][allowed], logits[1][allowed])


def test_overlap_scheduling_waits_for_a_constrained_token(llm):
    """Overlap forced on (CPU: the bookkeeping only): a constrained request's text equals the
    non-overlapped engine's, next to a free request."""
    engine = LLMEngine(llm.engine.config, llm.engine.source, llm.tokenizer, runner=llm.engine.runner, overlap=True)
    prompt = llm.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    guided = SamplingParams(temperature=0, max_tokens=40, guided=GuidedDecoding("json_schema", json.dumps(PERSON)))
    free = SamplingParams(temperature=0, max_tokens=10)
    a = engine.add_request(ids, guided)
    b = engine.add_request(ids, free)
    for _ in engine.iter_outputs():
        pass
    expected = texts(llm.generate([{"prompt_token_ids": ids}] * 2, [guided, free]))
    assert [engine.get_output(a).outputs[0].text, engine.get_output(b).outputs[0].text] == expected
    jsonschema.validate(json.loads(expected[0]), PERSON)


def test_a_handed_off_request_continues_its_grammar_from_the_prefill_token(llm):
    """PD in one process: the prefill engine samples the first token under the mask, the
    decode engine (its own runner and cache) takes that token into its own grammar state and
    goes on: the answer is the colocated engine's, token for token (greedy; the copied KV is
    the bytes the colocated engine computed, so no tolerance is involved)."""
    from flotilla.cluster.engine.kv_handoff import handoff, tensor_block_copier

    params = SamplingParams(temperature=0, max_tokens=40, guided=GuidedDecoding("json_schema", json.dumps(PERSON)))
    prompt = llm.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    colocated = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    decoder = LLMEngine(llm.engine.config, llm.engine.source, llm.tokenizer)
    try:
        copy = tensor_block_copier(llm.engine.runner.kv_caches, decoder.runner.kv_caches)
        ticket, decode_id = handoff(llm.engine, decoder, ids, copy, params)
        assert ticket.first_token == colocated.token_ids[0]
        while not decoder.get_output(decode_id).finished:
            decoder.step()
        handed = decoder.pop_output(decode_id).outputs[0]
    finally:
        decoder.runner.shutdown()
    assert handed.token_ids == colocated.token_ids and handed.finish_reason == "stop"
    jsonschema.validate(json.loads(handed.text), PERSON)
