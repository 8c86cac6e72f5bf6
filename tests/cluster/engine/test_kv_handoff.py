"""Prefill/decode KV handoff between two in-process engines (no Ray): the decode
engine's greedy tokens equal a colocated engine's, the prefill engine's blocks are
freed after the copy, and a failed copy is recomputed or fails its request without leaking
blocks. The decode side's remote-KV state (``WAITING_FOR_REMOTE_KV``) is checked with fake
blocks at the end, and with a read that the test ends by hand (:class:`HeldRead`).

Exact token equality needs no tolerance: the tiny Llama's logits are spread far above
float32 summation noise (see ``save_tiny_llama``), and the copied KV is bit-identical to
what the colocated engine computes (the same model and kernels on the same device).
"""

import uuid
from concurrent.futures import Future

import pytest

from flotilla.cluster.engine.kv_contract import KVHandoffError, PrefillTicket
from flotilla.cluster.engine.kv_handoff import (
    decode_prefilled,
    handoff,
    prefill,
    release_prefill,
    tensor_block_copier,
    transport_block_copier,
)
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BLOCK = 16


def make_engine(path, **flags):
    source = resolve_model_source(path)
    args = ServerArgs.create(model_path=str(source.path), **{"max_total_tokens": 512, **flags})
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    engine = LLMEngine(config, source)
    assert engine.runner.kv_layout.block_size == BLOCK
    return engine


def finish(engine, request_id):
    while not engine.get_output(request_id).finished:
        engine.step()
    return engine.pop_output(request_id).outputs[0].token_ids


def record_steps(engine):
    """Wrap ``engine.runner.execute`` to record each step's ``num_new_tokens`` per request."""
    steps, execute = [], engine.runner.execute

    def recording(step, rows):
        steps.append([item.num_new_tokens for item in step.scheduled])
        return execute(step, rows)

    engine.runner.execute = recording
    return steps


def assert_no_leaks(engine):
    engine.scheduler.check_invariants()
    assert engine.scheduler.pool.num_used_blocks == 0
    assert engine.scheduler.num_held_blocks == 0
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def engines(tiny_llama_prompts):
    path, prompts = tiny_llama_prompts
    colocated = make_engine(path)
    expected = [finish(colocated, colocated.add_request(p, GREEDY)) for p in prompts]
    return path, prompts, expected


def test_decode_after_a_tensor_copy_gives_the_colocated_tokens(engines):
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    steps = record_steps(decoder)
    copy = tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches)
    for prompt, want in zip(prompts, expected):
        result, decode_id = handoff(prefiller, decoder, prompt, copy, GREEDY)
        assert result.num_tokens == len(prompt) and len(result.block_ids) == -(-len(prompt) // BLOCK)
        assert result.first_token == want[0]
        # Released: only free prefix-cache blocks are left on the prefill side.
        assert_no_leaks(prefiller)
        assert finish(decoder, decode_id) == want
        assert_no_leaks(decoder)
    # The decode engine never computed a prompt: every step decodes one token.
    assert steps and all(counts == [1] for counts in steps)


def test_a_speculating_decode_engine_gives_the_colocated_tokens(engines):
    """The decode side of a handoff speculates (NGRAM): its steps verify drafts after the
    prefilled first token, and its tokens are the colocated engine's."""
    path, prompts, expected = engines
    prefiller = make_engine(path)
    decoder = make_engine(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    steps = record_steps(decoder)
    copy = tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches)
    for prompt, want in zip(prompts, expected):
        _, decode_id = handoff(prefiller, decoder, prompt, copy, GREEDY)
        assert finish(decoder, decode_id) == want
        assert_no_leaks(decoder)
    assert decoder.stats()["spec_decode_num_draft_tokens"] > 0
    assert any(counts[0] > 1 for counts in steps)  # a step computed 1 + k positions


def test_float8_caches_hand_off_their_bytes(engines):
    """Float8 caches (``kv_cache_dtype=fp8_e4m3``) copy as stored: the decode engine's tokens
    equal a colocated float8 engine's (the same bytes, the same kernels). A float8 cache and a
    float32 one do not pair."""
    path, prompts, _ = engines
    colocated = make_engine(path, kv_cache_dtype="fp8_e4m3")
    prefiller, decoder = make_engine(path, kv_cache_dtype="fp8_e4m3"), make_engine(path, kv_cache_dtype="fp8_e4m3")
    copy = tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches)
    for prompt in prompts:
        want = finish(colocated, colocated.add_request(prompt, GREEDY))
        _, decode_id = handoff(prefiller, decoder, prompt, copy, GREEDY)
        assert finish(decoder, decode_id) == want
        assert_no_leaks(decoder)
    with pytest.raises(ValueError, match="src_caches hold torch.float8_e4m3fn and dst_caches torch.float32"):
        tensor_block_copier(prefiller.runner.kv_caches, make_engine(path).runner.kv_caches)


def test_the_copied_kv_is_what_the_decode_uses(engines):
    """Negative control: a copy that moves nothing leaves the fresh (zero) cache in place,
    and the 40-token prompt's continuation changes, so the test above can fail."""
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    _, decode_id = handoff(prefiller, decoder, prompts[2], lambda src, dst: None, GREEDY)
    tokens = finish(decoder, decode_id)
    assert tokens[0] == expected[2][0] and tokens != expected[2]


def test_prefix_cached_blocks_are_not_copied_again(engines):
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    tensor_copy = tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches)
    copied = []

    def copy(src, dst):
        copied.append(len(dst))
        tensor_copy(src, dst)

    for _ in range(2):
        _, decode_id = handoff(prefiller, decoder, prompts[2], copy, GREEDY)
        assert finish(decoder, decode_id) == expected[2]
    # 40 tokens = 3 blocks; the second time the 2 full blocks come from the decode prefix cache.
    assert copied == [3, 1]
    assert_no_leaks(prefiller)
    assert_no_leaks(decoder)


def test_decode_through_an_in_process_nixl_transport(engines, monkeypatch):
    path, prompts, expected = engines
    # NOTE: nixl is a pinned dependency: a missing one is an install defect, so no skip.
    from flotilla.cluster.kv.transport import NixlTransport
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    prefiller, decoder = make_engine(path), make_engine(path)
    tag = uuid.uuid4().hex[:8]
    source, sink = NixlTransport(f"prefill-{tag}"), NixlTransport(f"decode-{tag}")
    try:
        source.register(prefiller.runner.kv_caches)
        sink.register(decoder.runner.kv_caches)
        sink.connect("prefill", source.metadata())
        copy = transport_block_copier(sink, "prefill", timeout_s=10.0)
        for prompt, want in zip(prompts, expected):
            _, decode_id = handoff(prefiller, decoder, prompt, copy, GREEDY)
            assert finish(decoder, decode_id) == want
        # The transport's injected failure goes through the recompute policy.
        sink.fail_next_reads = 1
        _, decode_id = handoff(prefiller, decoder, prompts[1], copy, GREEDY)
        assert sink.fail_next_reads == 0 and finish(decoder, decode_id) == expected[1]
    finally:
        sink.close()
        source.close()
    assert_no_leaks(prefiller)
    assert_no_leaks(decoder)


def failing_copy(src, dst):
    raise OSError("link down")


def test_a_failed_copy_is_recomputed_under_the_recompute_policy(engines):
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    steps = record_steps(decoder)
    for prompt, want in zip(prompts, expected):
        _, decode_id = handoff(prefiller, decoder, prompt, failing_copy, GREEDY, policy="recompute")
        assert_no_leaks(prefiller)
        output = finish(decoder, decode_id)
        assert output == want
        assert_no_leaks(decoder)
    # The prompts were computed on the decode engine.
    assert [counts for counts in steps if counts != [1]] == [[len(p)] for p in prompts]


def test_a_failed_copy_fails_the_request_under_the_fail_policy_and_leaks_nothing(engines):
    path, prompts, _ = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    for prompt in prompts:
        _, decode_id = handoff(prefiller, decoder, prompt, failing_copy, GREEDY, request_id="r", policy="fail")
        # NOTE: the read ended (failed) inside handoff: the request finished with an error.
        output = decoder.pop_output(decode_id)
        assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
        assert "OSError: link down" in output.error and "kv_load_failure_policy='fail'" in output.error
        assert_no_leaks(prefiller)
        assert_no_leaks(decoder)
    # The failed id is free for reuse on both sides.
    assert finish(decoder, decoder.add_request(prompts[0], GREEDY, request_id="r"))


def test_a_read_that_cannot_start_raises_under_the_fail_policy(engines):
    """No KV endpoint on the decode runner: its ``kv`` handle refuses to start the read, and
    under ``fail`` nothing is queued."""
    path, prompts, _ = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    ticket = prefill(prefiller, prompts[1], GREEDY)
    try:
        with pytest.raises(KVHandoffError, match="could not start.*no KV endpoint attached.*'fail'"):
            decoder.add_prefilled_request(ticket, GREEDY, request_id="x", policy="fail")
        assert_no_leaks(decoder)
        # Under recompute the request computes its prompt here.
        decode_id = decoder.add_prefilled_request(ticket, GREEDY, policy="recompute")
        assert len(finish(decoder, decode_id)) == GREEDY.max_tokens
    finally:
        release_prefill(prefiller, ticket)
    assert_no_leaks(decoder)


def test_a_busy_decode_engine_computes_the_prompt_itself(engines):
    """A prefilled request never jumps the decode engine's FCFS queue: with another
    request waiting, it is queued as an ordinary request (and still gives the same tokens)."""
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    copied = []
    first = decoder.add_request(prompts[0], GREEDY)
    _, decode_id = handoff(prefiller, decoder, prompts[2], lambda s, d: copied.append(d), GREEDY)
    assert copied == []
    assert finish(decoder, decode_id) == expected[2]
    assert finish(decoder, first) == expected[0]
    assert_no_leaks(decoder)
    assert_no_leaks(prefiller)


def test_a_streamed_handoff_yields_the_first_token_then_the_decode(engines):
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    result = prefill(prefiller, prompts[1], GREEDY)
    copy = tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches)
    decode_id = decode_prefilled(decoder, result, copy, GREEDY, stream=True)
    release_prefill(prefiller, result)
    deltas = list(decoder.stream(decode_id))
    assert deltas[0].token_ids == [expected[1][0]]
    assert [t for d in deltas for t in d.token_ids] == expected[1] and deltas[-1].finish_reason == "length"
    assert_no_leaks(decoder)
    assert_no_leaks(prefiller)


def test_prefill_keeps_blocks_until_released(engines):
    path, prompts, _ = engines
    prefiller = make_engine(path)
    ticket = prefill(prefiller, prompts[1], GREEDY)
    assert ticket.prompt_token_ids == prompts[1] and ticket.finish_reason == "length"
    assert prefiller.scheduler.pool.num_used_blocks == len(ticket.block_ids) == 2
    assert prefiller.held_kv_blocks(ticket.prefill_request_id) == ticket.block_ids
    prefiller.scheduler.check_invariants()
    assert release_prefill(prefiller, ticket) and not release_prefill(prefiller, ticket)
    assert prefiller.held_kv_blocks(ticket.prefill_request_id) is None
    assert_no_leaks(prefiller)


def test_a_prefill_that_only_held_blocks_keep_out_raises_instead_of_looping(engines):
    path, prompts, _ = engines
    # NOTE: 64 tokens of pool: three 20-token prefills hold 2 blocks each; the fourth cannot fit
    # until someone releases, and in an offline prefill() nobody else can.
    prefiller = make_engine(path, max_total_tokens=64)
    held = [prefill(prefiller, [5 + i] * 20, GREEDY) for i in range(2)]
    with pytest.raises(KVHandoffError, match=r"the KV pool is full of blocks held for earlier prefills"):
        prefill(prefiller, [9] * 40, GREEDY)
    for result in held:
        release_prefill(prefiller, result)
    assert_no_leaks(prefiller)
    assert prefill(prefiller, [9] * 40, GREEDY).block_ids


def ticket_of(prompt, first_token=5, blocks=(0,)) -> PrefillTicket:
    return PrefillTicket("t", "t", list(prompt), first_token, list(blocks), "length")


def test_bad_handoff_arguments_are_refused(engines):
    path, prompts, _ = engines
    decoder = make_engine(path)
    with pytest.raises(ValueError, match="policy"):
        decoder.add_prefilled_request(ticket_of(prompts[0]), GREEDY, policy="retry")
    with pytest.raises(ValueError, match="first_token"):
        decoder.add_prefilled_request(ticket_of(prompts[0], first_token=999), GREEDY)
    with pytest.raises(NotImplementedError, match="n=1"):
        decoder.add_prefilled_request(ticket_of(prompts[0]), SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError, match="block_ids: 2 blocks"):
        decoder.add_prefilled_request(ticket_of(prompts[2], blocks=(0, 1)), GREEDY)
    with pytest.raises(ValueError, match="timeout_s=0"):
        decoder.add_prefilled_request(ticket_of(prompts[0]), GREEDY, timeout_s=0)
    with pytest.raises(ValueError, match="hold_kv=True needs n=1"):
        decoder.add_request(prompts[0], SamplingParams(n=2, max_tokens=1), hold_kv=True)
    assert_no_leaks(decoder)


class HeldRead:
    """A reader whose reads end when the test says: ``finish(i)`` copies read ``i``'s blocks
    (through ``copy``) and completes it, ``fail(i)`` fails it."""

    def __init__(self, copy):
        self.copy, self.reads = copy, []

    def start_read(self, peer_id, src, dst, timeout_s, connect_with=None, dp_rank=None):
        self.reads.append((list(src), list(dst), Future()))
        return self.reads[-1][2]

    def forget(self, peer_id):
        pass

    def finish(self, index=-1):
        src, dst, future = self.reads[index]
        self.copy(src, dst)
        future.set_result(len(dst))

    def fail(self, index=-1):
        self.reads[index][2].set_exception(OSError("link down"))


def test_a_decode_engine_steps_other_requests_while_a_read_is_in_flight(engines):
    """Remote KV is a request state: while its read is in flight the prefilled request holds
    its blocks and waits, unscheduled; the other request decodes every step; the step that
    sees the read done puts it in the batch, its first token that step's first delta."""
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    reader = HeldRead(tensor_block_copier(prefiller.runner.kv_caches, decoder.runner.kv_caches))
    steps = record_steps(decoder)
    other = decoder.add_request(prompts[0], GREEDY)
    decoder.step()  # the other request's prompt
    ticket = prefill(prefiller, prompts[2], GREEDY)
    # NOTE: the FCFS rule lets a prefilled request in only as the sole waiting one.
    decode_id = decoder.add_prefilled_request(ticket, GREEDY, reader=reader, stream=True)
    request = decoder.scheduler.get(decode_id)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and len(request.block_ids) == 3
    assert decoder.scheduler.num_loading == 1 and decoder.scheduler.num_running == 1
    for _ in range(3):
        deltas = decoder.step()
        assert [d.request_id for d in deltas] == [other]
        decoder.scheduler.check_invariants()
    assert steps[-3:] == [[1], [1], [1]]
    reader.finish()
    release_prefill(prefiller, ticket)
    deltas = decoder.step()
    assert (deltas[0].request_id, deltas[0].token_ids) == (decode_id, [expected[2][0]])
    assert steps[-1] == [1, 1]  # both decode in the step that saw the read done
    assert finish(decoder, decode_id) == expected[2]
    assert finish(decoder, other) == expected[0]
    assert_no_leaks(decoder)


def test_an_abort_during_the_read_frees_the_blocks_only_when_the_read_ends(engines):
    path, prompts, _ = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    writes = []
    reader = HeldRead(lambda src, dst: writes.append(dst))
    ticket = prefill(prefiller, prompts[2], GREEDY)
    decode_id = decoder.add_prefilled_request(ticket, GREEDY, reader=reader)
    blocks = list(decoder.scheduler.get(decode_id).block_ids)
    assert decoder.abort(decode_id)
    assert decoder.pop_output(decode_id).outputs[0].finish_reason == "abort"
    # The read still writes into the blocks: they stay referenced (draining), and the engine
    # keeps stepping until the read ended.
    decoder.step()
    assert decoder.scheduler.pool.num_used_blocks == len(blocks) and decoder.scheduler.num_draining_blocks == 3
    assert decoder.has_unfinished_requests()
    decoder.scheduler.check_invariants()
    with pytest.raises(ValueError, match="aborted while its KV read is in flight"):
        decoder.add_request(prompts[0], GREEDY, request_id=decode_id)
    reader.finish()
    decoder.step()
    assert writes == [blocks]
    assert_no_leaks(decoder)
    release_prefill(prefiller, ticket)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_read_that_fails_later_follows_the_policy(engines, policy):
    path, prompts, expected = engines
    prefiller, decoder = make_engine(path), make_engine(path)
    reader = HeldRead(lambda src, dst: None)
    ticket = prefill(prefiller, prompts[1], GREEDY)
    decode_id = decoder.add_prefilled_request(ticket, GREEDY, reader=reader, policy=policy)
    decoder.step()
    reader.fail()
    release_prefill(prefiller, ticket)
    if policy == "recompute":
        assert finish(decoder, decode_id) == expected[1]
    else:
        decoder.step()
        output = decoder.pop_output(decode_id)
        assert output.outputs[0].finish_reason == "error" and "OSError: link down" in output.error
    assert_no_leaks(decoder)


# ---- scheduler bookkeeping with fake blocks (no model) --------------------------------


def test_scheduler_hold_and_release_keep_reference_counts_right():
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    request = Request("a", list(range(10)), max_tokens=1)
    scheduler.add(request)
    step = scheduler.schedule()
    scheduler.update(step, {"a": 99})
    held = scheduler.hold_blocks("a")
    scheduler.finish("a", RequestStatus.FINISHED_LENGTH)
    assert len(held) == 3 and scheduler.pool.num_used_blocks == 3 and scheduler.num_held_blocks == 3
    scheduler.check_invariants()
    # A new request sharing the prefix takes the held full blocks as cached blocks.
    other = Request("b", list(range(10)), max_tokens=1)
    scheduler.add(other)
    scheduler.schedule()
    assert other.block_ids[:2] == held[:2] and scheduler.pool.ref_count(held[0]) == 2
    assert scheduler.release_held_blocks("a") == held and scheduler.release_held_blocks("a") is None
    scheduler.check_invariants()


def test_scheduler_admit_prefilled_waits_for_the_kv_then_counts_the_prompt_as_computed():
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64))
    scheduler.add(Request("a", list(range(10)), max_tokens=4))
    blocks, num_cached = scheduler.admit_prefilled("a")
    request = scheduler.get("a")
    assert (len(blocks), num_cached) == (3, 0)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and request.num_computed_tokens == 0
    assert scheduler.schedule().is_empty  # not scheduled while its KV is read
    scheduler.check_invariants()
    scheduler.remote_kv_loaded("a", 7)
    assert request.num_computed_tokens == 10 and request.output_token_ids == [7]
    step = scheduler.schedule()
    assert [(s.num_new_tokens, s.start_position) for s in step.scheduled] == [(1, 10)]
    scheduler.check_invariants()
    # A second request waits behind a waiting one: not admitted, stays an ordinary request.
    scheduler.add(Request("b", [1, 2], max_tokens=1))
    scheduler.add(Request("c", [3, 4], max_tokens=1))
    assert scheduler.admit_prefilled("c") is None and scheduler.get("c").status is RequestStatus.WAITING
    with pytest.raises(ValueError, match="fresh waiting request"):
        scheduler.admit_prefilled("a")
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        scheduler.remote_kv_loaded("b", 1)
    scheduler.check_invariants()
