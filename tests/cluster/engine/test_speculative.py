"""Speculative decoding (:mod:`flotilla.cluster.engine.speculative`): the n-gram trie, the
scheduler's draft slots, verification's exactness (greedy token for token, sampled by a
chi-square test against the target's own probabilities), NGRAM and STANDALONE on SmolLM2
against the engine without speculation (alone, batched with constrained requests, under
preemption, with stop strings, max_tokens and logprobs), NGRAM on a TP=2 worker group, and the
start-up refusals.

Greedy comparisons are exact token equality between two float32 computations of the same
model: one token per step, and 1 + k positions per step (a prefill-style forward). They differ
by summation order only (<= ~1e-4 on SmolLM2's logits, whose magnitude is ~20; <= 6e-6 on the
tiny Llama, ``helpers.margins.ENGINE_MIN_LEAD``); each test asserts its greedy choices lead the
runner-up by more than :data:`SMOLLM2_MIN_LEAD`, so none can flip between them on any CPU."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.dp_scheduler import build_scheduler
from flotilla.cluster.engine.group_runner import GroupRunner
from flotilla.cluster.engine.llm_engine import LLMEngine, scheduler_config_for
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.sampler import Sampler, SamplingRow, truncated_probs
from flotilla.cluster.engine.sampling_params import GuidedDecoding
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.cluster.engine.speculative import NgramProposer, Speculator, speculation_summary
from flotilla.resolution.config import ResolvedConfig, thaw
from flotilla.resolution.runtime_support import refusals

# Twice the float32 disagreement bound of the two computations (1e-4 on SmolLM2, see the
# module docstring), with 5x on top.
SMOLLM2_MIN_LEAD = 1e-3

CODE = """def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
"""
COPY_PROMPT = "Repeat this code exactly, renaming fibonacci to fib:\n\n" + CODE
PROMPTS = [COPY_PROMPT, "List the planets of the solar system, one per line.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_total_tokens=4096)
    yield engine
    engine.shutdown()


def engine_with(llm, **fields) -> LLMEngine:
    """An engine over ``llm``'s runner (no second load of the target) whose config sets ``fields``."""
    config = ResolvedConfig.build({**thaw(llm.engine.config.config), **fields}, llm.engine.config.env, ())
    return LLMEngine(config, llm.engine.source, llm.tokenizer, runner=llm.engine.runner)


def ngram(llm, num_draft_tokens: int = 8, **fields) -> LLMEngine:
    return engine_with(llm, speculative_algorithm="NGRAM", speculative_num_draft_tokens=num_draft_tokens, **fields)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Every prompt's first completion, all submitted at once."""
    added = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    for _ in engine.iter_outputs():
        pass
    return [engine.pop_output(r).outputs[0] for r in added]


def min_greedy_lead(completions) -> float:
    """The smallest lead of a greedy token over the runner-up (completions run with logprobs=2)."""
    leads = []
    for completion in completions:
        for step, token in zip(completion.logprobs, completion.token_ids):
            ranked = sorted(step.values(), key=lambda lp: lp.rank)
            assert ranked[0].rank == 1 and step[token].rank == 1
            leads.append(ranked[0].logprob - ranked[1].logprob)
    return min(leads)


# -- the n-gram trie ---------------------------------------------------------------------------


def decoding(request_id: str, tokens: list[int]) -> Request:
    """A request in decode whose tokens are ``tokens`` (all but the last in the cache)."""
    request = Request(request_id, tokens, max_tokens=64)
    request.num_computed_tokens = len(tokens) - 1
    return request


def test_ngram_drafts_the_most_frequent_continuation_of_the_longest_suffix():
    proposer = NgramProposer(max_trie_depth=6)
    # "1 2 3" is followed by "4 5" twice and by "9" once; the suffix to continue is "1 2 3".
    request = decoding("r", [1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5, 8, 1, 2, 3, 9, 0, 1, 2, 3])
    assert proposer.propose([(request, 2)]) == {"r": [4, 5]}
    # The trie is shared: another request's suffix finds the first one's continuation.
    other = decoding("s", [42, 7, 1, 2])
    assert proposer.propose([(request, 2), (other, 3)])["s"] == [3, 4, 5]
    # Nothing follows a suffix never seen before.
    assert proposer.propose([(decoding("t", [100, 101]), 3)]) == {}
    # A request that left decode is forgotten.
    proposer.propose([(other, 1)])
    assert set(proposer._states) == {"s"}


def test_ngram_windows_are_at_most_the_trie_depth():
    proposer = NgramProposer(max_trie_depth=3)
    proposer.propose([(decoding("r", [1, 2, 3, 4, 5]), 1)])

    def depth(node):
        return 0 if not node else 1 + max(depth(child) for _, child in node.values())

    assert depth(proposer.root) == 3
    # Windows of 1..3 tokens starting at each of the 5 positions, the last ones cut by the end.
    assert proposer.num_nodes == 3 + 3 + 3 + 2 + 1


def test_ngram_capacity_clears_a_full_trie_and_refills():
    proposer = NgramProposer(max_trie_depth=4, capacity=20)
    request = decoding("r", list(range(30)))
    proposer.propose([(request, 2)])
    assert proposer.num_clears >= 1 and proposer.num_nodes <= 20
    request.all_token_ids += [5, 6, 7, 5, 6]
    assert proposer.propose([(request, 1)]) == {"r": [7]}


def test_speculator_bounds_drafts_by_max_tokens_and_skips_what_may_not_draft():
    class Fixed:
        name = "FIXED"

        def propose(self, wants):
            return {r.request_id: [9] * 10 for r, _ in wants}

        def forget(self, request_id):
            pass

    speculator = Speculator(Fixed(), num_draft_tokens=4)
    near_end = decoding("a", [1, 2, 3])
    near_end.max_tokens, near_end.output_token_ids = 3, [1]
    prefill = Request("b", [1, 2, 3], max_tokens=64)
    barred = decoding("c", [1, 2])
    free = decoding("d", [1, 2])
    speculator.propose([near_end, prefill, barred, free], lambda r: r.request_id != "c")
    # max_tokens 3 with 1 sampled: this step emits at most 2 tokens, so 1 draft.
    assert [r.draft_token_ids for r in (near_end, prefill, barred, free)] == [[9], [], [], [9] * 4]


# -- the scheduler's draft slots -----------------------------------------------------------------


def scheduler(num_blocks: int, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, max_num_seqs=min(8, budget), max_num_batched_tokens=budget, block_size=4)
    return Scheduler(config, KVBlockPool(num_blocks, 4))


def decode_once(sched: Scheduler, request: Request) -> None:
    """Prefill ``request`` and sample one token, so it is in decode."""
    sched.add(request)
    step = sched.schedule()
    sched.update(step, {request.request_id: 50})


def test_the_scheduler_computes_drafts_and_frees_the_rejected_slots():
    sched = scheduler(num_blocks=16)
    request = Request("r", list(range(7)), max_tokens=32)
    decode_once(sched, request)
    assert (request.num_tokens, request.num_computed_tokens, len(request.block_ids)) == (8, 7, 2)
    request.draft_token_ids = [60, 61, 62, 63, 64]
    step = sched.schedule()
    (item,) = step.scheduled
    assert (item.num_new_tokens, item.start_position, item.samples) == (6, 7, True)
    assert item.token_ids == [50, 60, 61, 62, 63, 64]
    assert len(request.block_ids) == 4  # positions 0..12
    # Two drafts accepted, then a token of the target's own: three tokens emitted.
    sched.update(step, {"r": [60, 61, 70]})
    assert request.output_token_ids == [50, 60, 61, 70]
    assert (request.num_tokens, request.num_computed_tokens) == (11, 10)
    assert len(request.block_ids) == 3  # the block only rejected drafts reached is free again
    sched.check_invariants()
    with pytest.raises(ValueError, match="1 to 2 expected"):
        request.draft_token_ids = [80]
        sched.update(sched.schedule(), {"r": [80, 81, 82]})


def test_drafts_are_cut_to_the_budget_and_dropped_before_anyone_is_preempted():
    sched = scheduler(num_blocks=16, budget=3)
    request = Request("r", [1, 2, 3], max_tokens=32)
    decode_once(sched, request)
    request.draft_token_ids = [5, 6, 7, 8]
    (item,) = sched.schedule().scheduled
    assert item.draft_token_ids == (5, 6)  # 1 + 2 tokens fill the budget of 3
    # A full pool: the drafts go, nobody is preempted for them.
    sched = scheduler(num_blocks=3)
    # Both requests' next positions lie in blocks they hold; a's drafts would need new ones.
    first, second = Request("a", [1, 2], max_tokens=8), Request("b", [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    decode_once(sched, first)
    sched.add(second)
    sched.update(sched.schedule(), {"a": 9, "b": 9})
    assert sched.pool.num_free_blocks == 0
    first.draft_token_ids = [1, 2, 3, 4, 5, 6]
    step = sched.schedule()
    assert [i.draft_token_ids for i in step.scheduled] == [(), ()] and not step.preempted


# -- verification --------------------------------------------------------------------------------


def test_greedy_verification_accepts_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 1, 6]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    # Drafts 3, 4 match the target; 2 does not (the target says 1).
    (token,) = Sampler().sample(logits, [SamplingRow(greedy, draft_token_ids=(3, 4, 2))])
    assert [t.token_id for t in token.emitted] == [3, 4, 1]
    (token,) = Sampler().sample(logits, [SamplingRow(greedy, draft_token_ids=(3, 4, 1))])
    assert [t.token_id for t in token.emitted] == [3, 4, 1, 6]  # all accepted: the bonus token too
    (token,) = Sampler().sample(logits[:1], [SamplingRow(greedy)])
    assert token.token_id == 3 and token.continuation == ()


# Upper 0.1% points of the chi-square distribution (significance level 0.001).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
CHI2_999_WIDE = {
    **CHI2_999, 8: 26.12, 9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70,
}  # fmt: skip


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, over the bins expected to hold >= 5."""
    expected = expected_probs * counts.sum()
    keep = expected >= 5
    assert keep.sum() >= 2 and float(expected[~keep].sum()) < 0.01 * float(counts.sum())
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["plain", "truncated"],
)
def test_sampled_verification_keeps_the_target_distribution(params):
    """20,000 independent rows verify the drafts (d1, d2) = (2, 5) over fixed logits of 8
    tokens. The emitted tokens must be draws from the target: the first token ~ p0 (which
    accepts d1 with probability p0(d1)), the token after an accepted d1 ~ p1, after d1, d2 ~ p2.
    Each is a chi-square test at significance 0.001 (a correct sampler fails one in 1000 seeds;
    the seed is fixed, so the test is deterministic)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    logits[0, 2] += 1.0  # d1 = 2 likely enough that many rows reach the next positions
    logits[1, 5] += 1.0
    rows_n, drafts = 20_000, (2, 5)
    probs = truncated_probs(logits, [params] * 3)
    sampler = Sampler(torch.Generator().manual_seed(1))
    tokens = sampler.sample(logits.repeat(rows_n, 1), [SamplingRow(params, draft_token_ids=drafts)] * rows_n)
    emitted = [[t.token_id for t in token.emitted] for token in tokens]
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=8).float()
    second = torch.bincount(torch.tensor([e[1] for e in emitted if len(e) > 1]), minlength=8).float()
    third = torch.bincount(torch.tensor([e[2] for e in emitted if len(e) > 2]), minlength=8).float()
    assert all(len(e) == 1 or e[0] == 2 for e in emitted) and all(len(e) <= 2 or e[1] == 5 for e in emitted)
    for counts, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        stat, dof = chi_square(counts, p)
        assert stat < CHI2_999[dof], (stat, dof, counts.tolist(), p.tolist())
    # The acceptance rate of d1 is p0(d1): 4 standard deviations of a binomial proportion.
    accepted = sum(len(e) > 1 for e in emitted) / rows_n
    p_accept = float(probs[0, 2])
    assert abs(accepted - p_accept) < 4 * math.sqrt(p_accept * (1 - p_accept) / rows_n)


class FixedDrafts:
    """A proposer that drafts the same tokens for every request (the test's choice)."""

    name = "FIXED"

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, wants):
        return {request.request_id: list(self.drafts) for request, _ in wants}

    def forget(self, request_id):
        pass

    def observe(self, step):
        pass


def test_the_engine_samples_the_tiny_models_distribution_with_speculation(tiny_llama_prompts):
    """End to end on the tiny Llama (temperature 1, top-k 4): 3000 unseeded requests of 4
    tokens each verify the drafts (d2, d3) after their first token. Among those whose first
    token x1 is the most likely one, the joint of (x2, x3) must be the model's own
    p(x2 | x1) p(x3 | x1, x2), read from the plain engine's raw logprobs (top-4, renormalised
    as top-k does): a chi-square test at significance 0.001 with a fixed seed."""
    path, prompts = tiny_llama_prompts
    prompt = prompts[1]
    llm = LLM(path, max_total_tokens=8192, random_seed=3, speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    try:
        plain = engine_with(llm, speculative_algorithm=None)

        def top4(context):
            (out,) = run(plain, [context], [SamplingParams(temperature=0, max_tokens=1, logprobs=4)])
            step = out.logprobs[0]
            tokens = sorted(step, key=lambda t: step[t].rank)[:4]
            weights = torch.tensor([step[t].logprob for t in tokens]).exp()
            return tokens, weights / weights.sum()

        first, _ = top4(prompt)
        x1 = first[0]
        second, p2 = top4(prompt + [x1])
        joint = {}
        for x2, q2 in zip(second, p2):
            third, p3 = top4(prompt + [x1, x2])
            for x3, q3 in zip(third, p3):
                joint[(x2, x3)] = float(q2 * q3)
        d2 = second[0]
        d3 = top4(prompt + [x1, d2])[0][0]
        spec = llm.engine
        spec.speculator = Speculator(FixedDrafts([d2, d3]), num_draft_tokens=2)
        params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
        outputs = run(spec, [prompt] * 3000, [params] * 3000)
        pairs = [tuple(o.token_ids[1:3]) for o in outputs if o.token_ids[0] == x1]
        assert len(pairs) > 500
        keys = sorted(joint)
        assert set(pairs) <= set(keys)
        counts = torch.tensor([float(pairs.count(k)) for k in keys])
        stat, dof = chi_square(counts, torch.tensor([joint[k] for k in keys]))
        assert stat < CHI2_999_WIDE[dof], (stat, dof)
        stats = spec.stats()
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
        assert spec.scheduler.pool.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_a_constrained_row_needs_a_bitmask_for_every_drafted_position():
    row = SamplingRow(SamplingParams(), token_bitmask=torch.zeros(1, dtype=torch.int32), draft_token_ids=(1,))
    with pytest.raises(ValueError, match="needs a bitmask after each"):
        Sampler().sample(torch.zeros(2, 32), [row])
    # The mask after d1 = 3 allows token 7 only: the second position samples 7 although 9 leads.
    only = lambda token: torch.tensor([1 << token], dtype=torch.int32)  # noqa: E731
    logits = torch.zeros(2, 32)
    logits[0, 3], logits[1, 9] = 5.0, 5.0
    row = SamplingRow(SamplingParams(temperature=0), token_bitmask=only(3), draft_token_ids=(3,), draft_bitmasks=(only(7),))
    (token,) = Sampler().sample(logits, [row])
    assert [t.token_id for t in token.emitted] == [3, 7]


# -- the engine on SmolLM2 ----------------------------------------------------------------------


def greedy(max_tokens: int = 96, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, **kw)


def test_ngram_greedy_tokens_and_logprobs_equal_the_engine_without_speculation(llm):
    """Three chat prompts (one asks to copy a code block) alone and then together, and beside a
    constrained request (which never drafts): the tokens are the plain engine's, and so are
    the accepted tokens' logprobs (float32 of the same model in another summation order:
    within 1e-4, the bound in the module docstring)."""
    ids = [chat_ids(llm.tokenizer, p) for p in PROMPTS]
    params = [greedy()] * len(ids)
    base = run(engine_with(llm), ids, params)
    assert min_greedy_lead(base) > SMOLLM2_MIN_LEAD
    spec = ngram(llm)
    alone = [run(spec, [i], [greedy()])[0] for i in ids]
    guided = SamplingParams(temperature=0, max_tokens=24, guided=GuidedDecoding("regex", r"[a-z]+( [a-z]+)*", "regex"))
    together = run(spec, [*ids, ids[1]], [*params, guided])
    for outputs in (alone, together[:3]):
        assert [c.token_ids for c in outputs] == [c.token_ids for c in base]
        assert [c.text for c in outputs] == [c.text for c in base]
        for ours, theirs in zip(outputs, base):
            for a, b, token in zip(ours.logprobs, theirs.logprobs, ours.token_ids):
                assert abs(a[token].logprob - b[token].logprob) < 1e-4
    assert together[3].finish_reason == "length"
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    spec.scheduler.check_invariants()
    assert spec.scheduler.pool.num_used_blocks == 0


PEOPLE = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}


def min_constrained_lead(engine: LLMEngine, guided: GuidedDecoding, completion) -> float:
    """The smallest lead of a constrained greedy token over the best other token its grammar
    allowed there (from the top-5 raw logprobs; an allowed token outside them is below the 5th)."""
    from flotilla.cluster.engine.sampler import unpack_bitmasks

    state = engine.grammars.state_for(guided)
    leads = []
    for step, token in zip(completion.logprobs, completion.token_ids):
        mask = state.next_bitmask()
        allowed = None if mask is None else unpack_bitmasks(mask[None], engine.vocab_size)[0]
        others = [lp.logprob for t, lp in step.items() if t != token and (allowed is None or allowed[t])]
        floor = min(lp.logprob for lp in step.values())
        leads.append(step[token].logprob - max(others, default=floor))
        assert state.accept(token)
    return min(leads)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constrained_requests_verify_drafts_under_their_grammar(llm, backend):
    """A JSON-schema request drafts too: each drafted position is sampled under the grammar's
    mask after the drafts before it (the matcher rolled back after), drafts the grammar forbids
    are cut before the step, and the output is the plain engine's and valid."""
    import json

    import jsonschema

    ids = [chat_ids(llm.tokenizer, "Give three people as a JSON list of objects with a name and an age.")]
    guided = GuidedDecoding("json_schema", json.dumps(PEOPLE), "response_format")
    params = [SamplingParams(temperature=0, max_tokens=120, logprobs=5, guided=guided)]
    plain = engine_with(llm, grammar_backend=backend)
    base = run(plain, ids, params)[0]
    assert min_constrained_lead(plain, guided, base) > SMOLLM2_MIN_LEAD
    spec = ngram(llm, grammar_backend=backend)
    ours = run(spec, ids, params)[0]
    assert ours.token_ids == base.token_ids and ours.finish_reason == "stop"
    jsonschema.validate(json.loads(ours.text), PEOPLE)
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0


def test_ngram_under_preemption_keeps_the_tokens_and_leaks_no_block(llm):
    """Four copy-heavy requests over a pool of 32 blocks (512 tokens; each needs ~17 blocks,
    prompts differing from their first user token, so they share only the template's
    system-prompt blocks): the engine preempts and recomputes, drafts are dropped rather than
    preempting, and the tokens stay the plain engine's."""
    prompts = [chat_ids(llm.tokenizer, f"Task {i}. {COPY_PROMPT}") for i in range(4)]
    params = [greedy(max_tokens=64)] * 4
    base = run(engine_with(llm), prompts, params)
    assert min_greedy_lead(base) > SMOLLM2_MIN_LEAD
    spec = ngram(llm)
    small = dataclasses.replace(llm.engine.runner.kv_layout, num_blocks=32)
    spec.scheduler = build_scheduler(spec.config, scheduler_config_for(spec.config, small))
    outputs = run(spec, prompts, params)
    assert spec.scheduler.num_preemptions > 0
    assert [c.token_ids for c in outputs] == [c.token_ids for c in base]
    spec.scheduler.check_invariants()
    assert spec.scheduler.pool.num_used_blocks == 0


def test_stop_strings_eos_and_max_tokens_end_where_they_would_without_speculation(llm):
    """A stop string and max_tokens that fall inside a step's accepted drafts end the
    completion at the same token and text as without speculation."""
    ids = chat_ids(llm.tokenizer, COPY_PROMPT)
    base_full = run(engine_with(llm), [ids], [greedy()])[0]
    stop = "result *="
    assert stop in base_full.text
    cases = [greedy(stop=[stop]), greedy(stop=[stop], include_stop_str_in_output=True), greedy(max_tokens=37)]
    base = run(engine_with(llm), [ids] * 3, cases)
    outputs = [run(ngram(llm), [ids], [c])[0] for c in cases]
    for ours, theirs in zip(outputs, base):
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
    assert outputs[0].finish_reason == "stop" and outputs[2].finish_reason == "length" and len(outputs[2].token_ids) == 37


def test_standalone_with_smollm2_as_its_own_draft_accepts_every_greedy_draft(llm):
    """STANDALONE with the target itself as the draft model (one token per step in the draft
    runner, 1 + 3 positions in the target's): greedy tokens are the plain engine's, and every
    draft is accepted but where the two summation orders could split a near-tie (none here:
    the leads are above SMOLLM2_MIN_LEAD). The draft pool's blocks go with the requests."""
    ids = [chat_ids(llm.tokenizer, p) for p in PROMPTS[1:]]
    params = [greedy(max_tokens=48)] * len(ids)
    base = run(engine_with(llm), ids, params)
    assert min_greedy_lead(base) > SMOLLM2_MIN_LEAD
    spec = engine_with(
        llm, speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_draft_model_path="smollm2",
        speculative_draft_model_revision="main",
    )  # fmt: skip
    assert spec.speculator.num_draft_tokens == 3
    outputs = run(spec, ids, params)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in base]
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0
    assert spec.speculator.proposer.num_held_blocks == 0


def test_a_poor_draft_model_changes_the_speed_not_the_tokens(llm):
    """STANDALONE with random draft weights (--speculative-draft-load-format dummy) and a
    bfloat16 draft cache (--speculative-draft-kv-cache-dtype): few drafts are accepted, and the
    greedy tokens are still the target's."""
    ids = [chat_ids(llm.tokenizer, PROMPTS[1])]
    base = run(engine_with(llm), ids, [greedy(max_tokens=32)])
    assert min_greedy_lead(base) > SMOLLM2_MIN_LEAD
    spec = engine_with(
        llm, speculative_algorithm="STANDALONE", speculative_num_steps=2, speculative_draft_model_path="smollm2",
        speculative_draft_load_format="dummy", speculative_draft_kv_cache_dtype="bfloat16",
    )  # fmt: skip
    draft_runner = spec.speculator.proposer.runner
    assert draft_runner.startup_report()["kv_cache_dtype"] == "bfloat16"
    assert [c.token_ids for c in run(spec, ids, [greedy(max_tokens=32)])] == [c.token_ids for c in base]
    assert spec.stats()["spec_decode_acceptance_rate"] < 0.5


def test_the_draft_model_is_found_by_path_and_revision(llm):
    with pytest.raises(ValueError, match=r"speculative_draft_model_revision='v2'.*--revision"):
        engine_with(
            llm, speculative_algorithm="STANDALONE", speculative_num_steps=2, speculative_draft_model_path="smollm2",
            speculative_draft_model_revision="v2",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"speculative_draft_model_path='/no/such/model'"):
        engine_with(llm, speculative_algorithm="STANDALONE", speculative_num_steps=2, speculative_draft_model_path="/no/such/model")


def test_ngram_fields_reach_the_proposer(llm):
    spec = ngram(llm, num_draft_tokens=5, speculative_ngram_max_trie_depth=9, speculative_ngram_capacity=1000)
    proposer = spec.speculator.proposer
    assert (spec.speculator.num_draft_tokens, proposer.max_trie_depth, proposer.capacity) == (4, 9, 1000)


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(llm):
    """A seeded sampled request verifies its drafts by sampling; its generator is put back to
    one draw per emitted token, so its tokens are those it samples without speculation, run
    after run (the second run's drafts differ: the trie holds the first run's tokens). The
    draws are exponential races decided by far more than the logits' float32 differences."""
    ids = chat_ids(llm.tokenizer, COPY_PROMPT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=64)
    base = run(engine_with(llm), [ids], [params])[0]
    spec = ngram(llm)
    first = run(spec, [ids], [params])[0]
    drafts_first = spec.stats()["spec_decode_num_draft_tokens"]
    again = run(spec, [ids], [params])[0]
    assert first.token_ids == base.token_ids == again.token_ids and len(base.token_ids) == 64
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0 and drafts_first > 0
    assert spec.scheduler.pool.num_used_blocks == 0


def test_speculation_is_described_for_the_serving_surface(llm):
    assert speculation_summary(llm.engine.config) is None
    assert speculation_summary(ngram(llm).config) == {"algorithm": "NGRAM", "num_draft_tokens": 7}
    with pytest.raises(ValueError, match="overlap=True cannot run with speculative decoding"):
        config = ResolvedConfig.build({**thaw(llm.engine.config.config), "speculative_algorithm": "NGRAM",
                                       "speculative_num_draft_tokens": 4}, llm.engine.config.env, ())  # fmt: skip
        LLMEngine(config, llm.engine.source, llm.tokenizer, runner=llm.engine.runner, overlap=True)


# -- a worker group ------------------------------------------------------------------------------


def test_ngram_on_a_tp2_worker_group_gives_hf_greedy_tokens(ray_cluster, tiny_llama_prompts):
    """NGRAM drafts on the driver and the group's rank 0 verifies them next to its logits: the
    tiny Llama's greedy tokens at TP=2 with speculation are HF's (every choice leads the
    runner-up by more than ENGINE_MIN_LEAD, asserted). Over 160 tokens the random model falls
    into loops, so drafts are accepted."""
    from transformers import LlamaForCausalLM

    from helpers.margins import ENGINE_MIN_LEAD
    from helpers.tiny_models import hf_greedy

    path, prompts = tiny_llama_prompts
    new_tokens = 160
    model = LlamaForCausalLM.from_pretrained(path).eval()
    expected = [hf_greedy(model, p, new_tokens, min_lead=ENGINE_MIN_LEAD) for p in prompts[:2]]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = prompts[:2]
    grouped = LLM(path, max_total_tokens=1024, tp_size=2, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    try:
        assert isinstance(grouped.engine.runner, GroupRunner)
        assert [o.outputs[0].token_ids for o in grouped.generate(prompts, params)] == expected
        assert grouped.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        grouped.shutdown()


# -- NEXTN: the checkpoint's MTP layers --------------------------------------------------------




def finish_then_batched_then_preempted(llm, request_id, its_tokens, prompts, params, expected) -> None:
    """A hidden-state drafter's engine finishes ``request_id`` (its greedy tokens
    ``its_tokens``), then runs ``prompts`` batched, then again over a pool of 6 blocks of 16
    tokens (three requests of up to 50: preemption): the tokens stay ``expected``, drafts were
    verified, and no block stays used."""
    engine = llm.engine
    for _ in engine.iter_outputs():
        pass
    assert engine.pop_output(request_id).outputs[0].token_ids == its_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
    small = dataclasses.replace(engine.runner.kv_layout, num_blocks=6)
    engine.scheduler = build_scheduler(engine.config, scheduler_config_for(engine.config, small))
    engine.speculator.proposer.pool = engine.scheduler.pool
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert engine.scheduler.num_preemptions > 0
    engine.scheduler.check_invariants()
    assert engine.scheduler.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_v3_mtp(tmp_path_factory):
    """``(path, HF main model, HF MTP module)``: a tiny random DeepSeek-V3 with one MTP layer in
    DeepSeek's checkpoint layout (as tests/cluster/models/test_mtp.py saves it)."""
    import json

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    from helpers.tiny_deepseek import TINY_DEEPSEEK_V3_MTP
    from helpers.tiny_dsa import add_checkpoint_tensors, mtp_checkpoint_tensors
    from helpers.tiny_fp8 import randomize
    from helpers.tiny_glm import randomize_correction_bias

    def randomized(module, seed):
        randomize(module, seed)
        randomize_correction_bias(module, seed)
        return module.eval()

    torch.manual_seed(0)
    main = randomized(DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK_V3_MTP)), 0)
    mtp = randomized(MtpModel(main, 1), 7)
    path = tmp_path_factory.mktemp("tiny-v3-mtp")
    main.save_pretrained(path)
    add_checkpoint_tensors(path, mtp_checkpoint_tensors(main, mtp.state_dict(), TINY_DEEPSEEK_V3_MTP["num_hidden_layers"]))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return str(path), main, mtp


def test_nextn_drafts_transformers_mtp_prediction_and_keeps_the_greedy_tokens(tiny_v3_mtp):
    """NEXTN on a tiny DeepSeek-V3: after the prefill, the first draft is what transformers'
    MTP layer predicts from the main model's final hidden states and the shifted tokens (its
    logits agree within 1e-4, test_mtp.py; the argmax leads by more); the greedy tokens with
    speculation are HF's (leads above ENGINE_MIN_LEAD, asserted), alone and under preemption;
    the MTP layer's random weights rarely guess right, which changes speed, not tokens."""
    from helpers.margins import ENGINE_MIN_LEAD, topk_margin
    from helpers.tiny_models import hf_greedy

    path, main, mtp = tiny_v3_mtp
    prompts = [[5, 9, 17, 3, 44, 9, 17, 3, 60, 2], list(range(20, 46)), [7, 7, 8, 8, 9, 9, 100, 101]]
    new_tokens = 24
    expected = [hf_greedy(main, p, new_tokens, min_lead=ENGINE_MIN_LEAD) for p in prompts]
    llm = LLM(path, max_total_tokens=1024, speculative_algorithm="NEXTN")  # resolution: 3 steps, top-1
    try:
        engine = llm.engine
        assert engine.speculator.name == "NEXTN" and engine.speculator.num_draft_tokens == 3
        assert speculation_summary(engine.config) == {"algorithm": "NEXTN", "num_draft_tokens": 3}
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        rid = engine.add_request(prompts[0], params)
        engine.step()  # the prefill: the first token, and the MTP layer over the prompt
        first = engine.get_output(rid).outputs[0].token_ids[0]
        with torch.no_grad():
            hidden = main.model(torch.tensor([prompts[0]])).last_hidden_state
            ids = torch.tensor([prompts[0][1:] + [first]])
            out = mtp.forward_layer(0, hidden, torch.arange(len(prompts[0]))[None], None, input_ids=ids)
            logits = mtp._project_to_logits(out)[0, -1]
        assert topk_margin(logits) > 2e-4
        assert engine.speculator.proposer._next[rid].token == int(logits.argmax())
        finish_then_batched_then_preempted(llm, rid, expected[0], prompts, params, expected)
    finally:
        llm.shutdown()


# -- EAGLE: a draft head over the target's features ---------------------------------------------


def save_eagle_head(path, target_dir, seed: int = 5, **extra):
    """A tiny EAGLE-1 head for the tiny Llama at ``target_dir``: ``fc`` (with a bias) over
    cat(embedding, feature) and one Llama decoder layer without its input norm, random.
    Returns ``(fc, layer)``, transformers modules holding the same weights (the oracle)."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = {**json.loads((target_dir / "config.json").read_text()), "num_hidden_layers": 1, "bias": True}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    layer = LlamaDecoderLayer(hf_config, 0).eval()
    hidden = hf_config.hidden_size
    fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
    for param in [*layer.parameters(), *fc.parameters()]:
        torch.nn.init.normal_(param, std=0.2)
    layer.input_layernorm = torch.nn.Identity()
    tensors = {f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()}
    tensors.update({"fc.weight": fc.weight.detach().contiguous(), "fc.bias": fc.bias.detach().contiguous(), **extra})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return fc, layer


def test_eagle_drafts_its_heads_prediction_and_keeps_the_greedy_tokens(tiny_llama_prompts, tmp_path):
    """EAGLE with a tiny EAGLE-1 head over the tiny Llama: after the prefill the first draft is
    the head's prediction computed by transformers (fc over the embeddings and the target's
    final hidden states, one decoder layer without input norm, the target's LM head; logits
    within float32 reordering, the argmax leading by more than 2e-4); the greedy tokens are
    HF's (leads above ENGINE_MIN_LEAD, asserted), batched and under preemption."""
    from pathlib import Path

    from transformers import LlamaForCausalLM

    from helpers.margins import ENGINE_MIN_LEAD, topk_margin
    from helpers.tiny_models import hf_greedy

    path, prompts = tiny_llama_prompts
    target = LlamaForCausalLM.from_pretrained(path).eval()
    fc, layer = save_eagle_head(tmp_path / "eagle", Path(path))
    new_tokens = 24
    expected = [hf_greedy(target, p, new_tokens, min_lead=ENGINE_MIN_LEAD) for p in prompts]
    llm = LLM(path, max_total_tokens=1024, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "eagle"))
    try:
        engine = llm.engine
        # Resolution's Llama defaults: 5 steps (its top-k 4 tree is drafted as one chain).
        assert engine.speculator.name == "EAGLE" and engine.speculator.num_draft_tokens == 5
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        prompt = prompts[2]
        rid = engine.add_request(prompt, params)
        engine.step()
        first = engine.get_output(rid).outputs[0].token_ids[0]
        with torch.no_grad():
            hidden = target.model(torch.tensor([prompt])).last_hidden_state
            ids = torch.tensor([prompt[1:] + [first]])
            x = fc(torch.cat([target.model.embed_tokens(ids), hidden], dim=-1))
            positions = torch.arange(len(prompt))[None]
            causal = torch.tril(torch.ones(len(prompt), len(prompt), dtype=torch.bool))[None, None]
            out = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=target.model.rotary_emb(x, positions))
            logits = target.lm_head(out[0] if isinstance(out, tuple) else out)[0, -1]
        assert topk_margin(logits) > 2e-4
        assert engine.speculator.proposer._next[rid].token == int(logits.argmax())
        finish_then_batched_then_preempted(llm, rid, expected[2], prompts, params, expected)
    finally:
        llm.shutdown()


def test_an_eagle3_head_is_refused_naming_the_draft_path(tiny_llama_prompts, tmp_path):
    from pathlib import Path

    path, _ = tiny_llama_prompts
    save_eagle_head(tmp_path / "eagle3", Path(path), **{"lm_head.weight": torch.zeros(256, 64)})
    with pytest.raises(ValueError, match=r"speculative_draft_model_path: the EAGLE head has its own 'lm_head.weight'"):
        LLM(path, max_total_tokens=256, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / "eagle3"))


# -- start-up refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, needle",
    [
        ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 drafting is not built yet"),
        ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "/x/head"}, "use EAGLE for an EAGLE head"),
        ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/x/head", "tp_size": 2}, "tp_size=2"),
        ({"speculative_algorithm": "NEXTN", "tp_size": 2}, "tp_size=2"),
        ({"speculative_algorithm": "STANDALONE"}, "pass --speculative-draft-model-path"),
        ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "smollm2", "tp_size": 2}, "tp_size=2"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "drop --speculative-num-steps"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "tree drafting is not built"),
        ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_acc": 0.5}, "relaxed acceptance"),
    ],
)
def test_settings_that_cannot_run_are_refused_naming_the_flag(given, needle):
    lines = [r.line for r in refusals(given)]
    assert any(needle in line for line in lines), lines
    assert refusals({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}) == ()
    assert refusals({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "smollm2"}) == ()


def test_nextn_on_a_model_without_mtp_layers_is_refused(tiny_v3_mtp):
    import json
    from pathlib import Path

    from flotilla.resolution import ModelFacts

    config = json.loads((Path(tiny_v3_mtp[0]) / "config.json").read_text())
    assert refusals({"speculative_algorithm": "NEXTN"}, ModelFacts.from_hf_config(config)) == ()
    (refusal,) = refusals({"speculative_algorithm": "NEXTN"}, ModelFacts.from_hf_config({**config, "num_nextn_predict_layers": 0}))
    assert "num_nextn_predict_layers is 0 or missing" in refusal.line
    done = subprocess.run(
        [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--speculative-algorithm", "NEXTN"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--speculative-algorithm NEXTN is not supported" in done.stderr and "MTP" in done.stderr


def test_flotilla_serve_exits_2_for_standalone_without_a_draft_model():
    done = subprocess.run(
        [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--speculative-algorithm", "STANDALONE"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--speculative-algorithm STANDALONE is not supported" in done.stderr
    assert "--speculative-draft-model-path" in done.stderr
