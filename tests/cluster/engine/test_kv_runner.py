"""The runner's KV handle (``runner.kv``: ``attach`` / ``metadata`` / ``connect`` /
``start_read`` / ``read`` / ...) on the in-process ModelRunner (the rank's port) and on
GroupRunner worker groups (a fan-out over the ranks' ports; real Ray actors on loopback, real
NIXL over UCX and the Ray-object fallback, tiny random Llamas).

Each handoff prefills a prompt on one engine (``hold_kv``), has the decode engine read its KV
blocks into its own cache through ``runner.kv`` (the read runs on the ranks' port threads, the
engine observes it between steps) under ``policy="fail"`` (a failed read fails the request, it
is never silently recomputed) and decodes there: the greedy tokens must equal a colocated
engine's, and the bytes read must be exactly the decode ranks' KV heads of the copied blocks.
Heterogeneous TP: a tp=1 rank holds both KV heads of the GQA model and a tp=2 rank one, so a
tp=1 -> tp=2 read takes one head of the peer's two, and tp=2 -> tp=1 gathers one head from each
peer rank; the MQA model (one KV head) is replicated on both ranks at tp=2.

Exact token equality needs no tolerance: the tiny models' logits are spread far above
float32 summation noise (see ``save_tiny_llama``), sharded reductions included.
"""

import dataclasses
import time
import pickle
import uuid
from contextlib import contextmanager

import pytest
import ray

from flotilla.cluster.distributed import Communicator
from flotilla.cluster.engine.group_runner import GroupRunner
from flotilla.cluster.engine.kv_handoff import decode_prefilled, prefill, release_prefill
from flotilla.cluster.kv.port import KVRankError, check_kv_attachable
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.group import WorkerGroupError
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.layers import kv_head_span
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.cluster.kv.endpoint import KVEndpointFactory
from helpers.prompts import random_prompts
from helpers.tiny_deepseek import save_tiny_deepseek_v2
from helpers.torch_threads import one_intra_op_thread

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENS = (5, 17, 40)  # under one block, two blocks, three blocks (of 16 tokens)
READ_TIMEOUT_S = 20.0


def save_tiny_mqa_llama(path):
    """The tiny Llama of ``save_tiny_llama`` with ONE KV head (4 query heads): at tp=2 both
    ranks hold that head (replicated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)


def resolved(source, **flags):
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=512, **flags)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))


def make_engine(path, tp_size: int | None = None) -> LLMEngine:
    """An engine over ``path``: in process (ModelRunner) when ``tp_size`` is None, else on a
    GroupRunner of ``tp_size`` worker actors (one actor at tp_size=1)."""
    source = resolve_model_source(path)
    config = resolved(source, tp_size=tp_size or 1)
    runner = ModelRunner(config, source) if tp_size is None else GroupRunner(config, source)
    return LLMEngine(config, source, runner=runner)


def finish(engine, request_id):
    while not engine.get_output(request_id).finished:
        engine.step()
    return engine.pop_output(request_id).outputs[0].token_ids


def world(engine) -> int:
    return len(engine.runner.group.actors) if isinstance(engine.runner, GroupRunner) else 1


@contextmanager
def attached(kind, *engines):
    """Fresh endpoints of ``kind`` on every engine's runner (unique names); detached at exit.
    Yields each engine's peer id (its factory's name)."""
    tag = uuid.uuid4().hex[:8]
    names = [f"{kind}-{i}-{tag}" for i in range(len(engines))]
    try:
        for engine, name in zip(engines, names):
            engine.runner.kv.attach(KVEndpointFactory(kind, name))
        yield names
    finally:
        for engine in engines:
            engine.runner.kv.detach()


class Reads:
    """The decode engine's KVReadListener: what each read moved, or how it failed."""

    def __init__(self):
        self.done, self.failed = [], []

    def kv_read_done(self, peer_id, num_blocks, num_bytes, seconds):
        self.done.append((num_blocks, num_bytes))

    def kv_read_failed(self, peer_id, num_blocks, error):
        self.failed.append(error)


def ticket_for(prefiller, prefill_id, prompt):
    """Prefill ``prompt``; its ticket names the prefill engine's KV peer and metadata."""
    ticket = prefill(prefiller, prompt, GREEDY)
    return dataclasses.replace(ticket, peer_id=prefill_id, peer_metadata=prefiller.runner.kv.metadata())


def read_into(decoder, ticket, policy="fail") -> str:
    """Queue ``ticket`` on ``decoder``, its KV read by ``decoder.runner.kv``, and step until
    the read ended; returns the decode request's id."""
    decode_id = decode_prefilled(decoder, ticket, decoder.runner.kv, GREEDY, policy=policy, timeout_s=READ_TIMEOUT_S)
    deadline = time.monotonic() + 2 * READ_TIMEOUT_S
    while decode_id in decoder.remote_kv:
        assert time.monotonic() < deadline, "the read never ended"
        decoder.step()
    return decode_id


def hand_off(prefiller, prefill_id, decoder, prompt, policy="fail"):
    """Prefill ``prompt`` on ``prefiller``, read its blocks into ``decoder`` (connecting the
    peer with the first read) and decode; returns ``(tokens, [(blocks, bytes) per read])``."""
    reads = decoder.remote_kv.listener = Reads()
    ticket = ticket_for(prefiller, prefill_id, prompt)
    try:
        decode_id = read_into(decoder, ticket, policy)
    finally:
        release_prefill(prefiller, ticket)
    assert reads.failed == []
    return finish(decoder, decode_id), reads.done


def assert_handoffs_match(prefiller, prefill_id, decoder, prompts, expected):
    """Every prompt's handoff gives the colocated tokens, after one read of all its blocks
    that moved exactly the decode ranks' KV (every rank its own heads, every layer, K and V)."""
    block_bytes = decoder.runner.kv_layout.block_size * decoder.runner.kv_layout.bytes_per_token * world(decoder)
    for prompt, want in zip(prompts, expected):
        tokens, reads = hand_off(prefiller, prefill_id, decoder, prompt)
        assert tokens == want
        blocks = -(-len(prompt) // 16)
        assert reads == [(blocks, blocks * block_bytes)]
        assert decoder.scheduler.pool.num_used_blocks == 0 and prefiller.scheduler.num_held_blocks == 0


class Reference:
    """Greedy tokens of a colocated in-process engine, memoised per prompt."""

    def __init__(self, path):
        self.engine = make_engine(path)
        self.tokens = {}

    def __call__(self, prompts):
        for p in prompts:
            if tuple(p) not in self.tokens:
                self.tokens[tuple(p)] = finish(self.engine, self.engine.add_request(p, GREEDY))
        return [self.tokens[tuple(p)] for p in prompts]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The driver's in-process engines run on one intra-op thread (see one_intra_op_thread)."""
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def gqa(tiny_llama_prompts):
    """``(path, reference)``: the tiny Llama with 2 KV heads (4 query heads)."""
    path, _ = tiny_llama_prompts
    return path, Reference(path)


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    """``(path, reference)``: the tiny Llama with 1 KV head."""
    path = str(tmp_path_factory.mktemp("tiny-mqa-llama"))
    save_tiny_mqa_llama(path)
    return path, Reference(path)


@pytest.fixture(scope="module")
def groups(ray_cluster, gqa):
    """GroupRunner engines of the GQA model at tp=2 and tp=1 (no endpoints attached)."""
    engines = [make_engine(gqa[0], tp_size=2), make_engine(gqa[0], tp_size=1)]
    yield engines
    for engine in engines:
        engine.runner.shutdown()


# ---- head spans --------------------------------------------------------------------------


def test_kv_head_span_follows_the_qkv_layout():
    assert kv_head_span(2, 1, 0) == (0, 2, 2)
    assert [kv_head_span(2, 2, r) for r in range(2)] == [(0, 1, 2), (1, 1, 2)]
    assert [kv_head_span(8, 4, r) for r in range(4)] == [(0, 2, 8), (2, 2, 8), (4, 2, 8), (6, 2, 8)]
    # Fewer KV heads than ranks: each head replicated on tp / Hkv consecutive ranks.
    assert [kv_head_span(2, 4, r) for r in range(4)] == [(0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]
    assert [kv_head_span(1, 2, r) for r in range(2)] == [(0, 1, 1), (0, 1, 1)]
    with pytest.raises(ValueError, match="tp_rank=2"):
        kv_head_span(2, 2, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        kv_head_span(3, 2, 0)


def test_runners_report_their_head_spans(gqa, mqa, tmp_path):
    assert gqa[1].engine.runner.kv_head_span() == (0, 2, 2)
    assert mqa[1].engine.runner.kv_head_span() == (0, 1, 1)
    save_tiny_deepseek_v2(tmp_path)
    source = resolve_model_source(str(tmp_path))
    assert ModelRunner(resolved(source), source, pack_weights=False).kv_head_span() == (0, 1, 1)  # MLA: replicated


# ---- handoffs -----------------------------------------------------------------------------


def test_in_process_runners_hand_off_through_nixl(gqa):
    path, reference = gqa
    prompts = random_prompts(PROMPT_LENS, 256, seed=11)
    prefiller, decoder = make_engine(path), make_engine(path)
    with attached("nixl", prefiller, decoder) as (prefill_id, _):
        assert len(prefiller.runner.kv.metadata()) == 1
        assert_handoffs_match(prefiller, prefill_id, decoder, prompts, reference(prompts))
    prefiller.runner.shutdown()
    decoder.runner.shutdown()


@pytest.mark.parametrize("kind", ["nixl", "ray"])
def test_group_runners_hand_off_across_tp_sizes(groups, gqa, kind):
    tp2, tp1 = groups
    reference = gqa[1]
    # NOTE: fresh prompts per transport: a prompt already in a decode engine's prefix cache
    # would copy fewer blocks.
    seed = 20 if kind == "nixl" else 30
    down, up = random_prompts(PROMPT_LENS, 256, seed=seed), random_prompts(PROMPT_LENS, 256, seed=seed + 1)
    with attached(kind, tp2, tp1) as (tp2_id, tp1_id):
        assert len(tp2.runner.kv.metadata()) == 2 and len(tp1.runner.kv.metadata()) == 1
        # tp=2 -> tp=1: the one decode rank gathers head 0 from rank 0 and head 1 from rank 1.
        assert_handoffs_match(tp2, tp2_id, tp1, down, reference(down))
        # tp=1 -> tp=2: each decode rank takes its own head of the one prefill rank's two.
        assert_handoffs_match(tp1, tp1_id, tp2, up, reference(up))


def test_a_replicated_kv_head_hands_off_between_in_process_and_group_runners(ray_cluster, mqa):
    """One KV head (Hkv < tp): both tp=2 ranks hold it; an in-process runner talks to a group."""
    path, reference = mqa
    local, group = make_engine(path), make_engine(path, tp_size=2)
    try:
        with attached("nixl", local, group) as (local_id, group_id):
            down = random_prompts(PROMPT_LENS, 256, seed=41)
            assert_handoffs_match(group, group_id, local, down, reference(down))
            up = random_prompts(PROMPT_LENS, 256, seed=42)
            assert_handoffs_match(local, local_id, group, up, reference(up))
    finally:
        group.runner.shutdown()
        local.runner.shutdown()


# ---- failures -----------------------------------------------------------------------------


def test_a_failed_read_names_the_rank_and_leaves_the_group_working(groups, gqa):
    tp2, tp1 = groups
    reference = gqa[1]
    prompts = random_prompts(PROMPT_LENS, 256, seed=51)
    expected = reference(prompts)
    with attached("nixl", tp1, tp2) as (tp1_id, _):
        reads = tp2.remote_kv.listener = Reads()
        # Only rank 1 fails its next read: the request fails naming it; rank 0 read fine.
        ray.get(tp2.runner.group.actors[1].kv.remote("set_fail_next_reads", 1), timeout=30)
        ticket = ticket_for(tp1, tp1_id, prompts[2])
        failed = tp2.pop_output(read_into(tp2, ticket, policy="fail"))
        assert failed.outputs[0].finish_reason == "error" and "kv_load_failure_policy='fail'" in failed.error
        assert "KVRankError: KV transfer on rank 1 failed: " in failed.error and "injected" in failed.error
        assert tp2.runner.group._error is None and tp2.scheduler.pool.num_used_blocks == 0
        # The same held blocks are read again, and the group decodes on.
        assert finish(tp2, read_into(tp2, ticket, policy="fail")) == expected[2]
        release_prefill(tp1, ticket)
        assert len(reads.failed) == 1 and len(reads.done) == 1

        # The handle's seam fails every rank's next read; under "recompute" the prompt is computed here.
        tp2.runner.kv.set_fail_next_reads(1)
        ticket = ticket_for(tp1, tp1_id, prompts[1])
        with pytest.raises(KVRankError, match="rank 0.*injected"):  # the lowest failing rank is named
            tp2.runner.kv.read(tp1_id, ticket.block_ids, list(range(len(ticket.block_ids))), READ_TIMEOUT_S)
        tp2.runner.kv.set_fail_next_reads(1)
        assert finish(tp2, read_into(tp2, ticket, policy="recompute")) == expected[1]
        release_prefill(tp1, ticket)

        # An unknown peer is each rank's KV error too, not a broken group.
        with pytest.raises(KVRankError, match="rank 0.*nobody"):
            tp2.runner.kv.read("nobody", [0], [0], READ_TIMEOUT_S)
        assert finish(tp2, tp2.add_request(prompts[0], GREEDY)) == expected[0]
        assert tp2.runner.group._error is None and tp2.dead is None


def test_a_group_steps_while_its_ranks_read(groups, gqa):
    """The ranks read on their ports' threads and answer at once: a read that takes 1.5 s
    (the delay seam) holds up none of the group's steps meanwhile."""
    tp2, tp1 = groups
    prompts = random_prompts([40, 9], 256, seed=61)
    expected = gqa[1](prompts)
    with attached("nixl", tp1, tp2) as (tp1_id, _):
        ticket = ticket_for(tp1, tp1_id, prompts[0])
        other = tp2.add_request(prompts[1], GREEDY)
        tp2.step()
        tp2.runner.kv.set_delay_next_reads(1.5)
        started = time.monotonic()
        decode_id = decode_prefilled(tp2, ticket, tp2.runner.kv, GREEDY, policy="fail", timeout_s=READ_TIMEOUT_S)
        assert time.monotonic() - started < 1.0  # start_read returned without waiting for the read
        longest, steps = 0.0, 0
        while decode_id in tp2.remote_kv:
            before = time.monotonic()
            tp2.step()
            longest, steps = max(longest, time.monotonic() - before), steps + 1
        took = time.monotonic() - started
        release_prefill(tp1, ticket)
        assert took >= 1.5 and steps >= 5 and longest < 0.5, (took, steps, longest)
        assert finish(tp2, decode_id) == expected[0] and finish(tp2, other) == expected[1]
    assert tp2.scheduler.pool.num_used_blocks == 0


def test_a_dead_rank_breaks_the_group(ray_cluster, gqa):
    engine = make_engine(gqa[0], tp_size=1)
    runner = engine.runner
    try:
        runner.kv.attach(KVEndpointFactory("nixl", f"dead-{uuid.uuid4().hex[:8]}"))
        with pytest.raises(RuntimeError, match="already attached"):
            runner.kv.attach(KVEndpointFactory("nixl", f"again-{uuid.uuid4().hex[:8]}"))
        assert len(runner.kv.metadata()) == 1  # the first endpoints are untouched
        ray.kill(runner.group.actors[0], no_restart=True)
        # NOTE: ray.kill returns before the actor is gone; a call may still be served meanwhile.
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerGroupError, match="rank 0 failed: its actor died"):
            while time.monotonic() < deadline:
                runner.kv.set_fail_next_reads(0)
        # Broken for good: every later call raises the same error, the engine fails its step.
        with pytest.raises(WorkerGroupError, match="rank 0"):
            runner.kv.read("x", [0], [0], READ_TIMEOUT_S)
        request_id = engine.add_request([5, 6, 7], GREEDY)
        engine.step()
        assert engine.dead is not None and engine.get_output(request_id).outputs[0].finish_reason == "error"
    finally:
        runner.shutdown()  # closing the endpoints of a broken group is best effort: no raise


# ---- attach rules -------------------------------------------------------------------------


def test_kv_attach_refuses_attention_cp_and_serves_dp_and_dcp_ranks(gqa, tmp_path):
    with pytest.raises(NotImplementedError, match="attn_cp_size=2"):
        check_kv_attachable(attn_cp_size=2)
    check_kv_attachable(1)  # DP attention and DCP are served: nothing to refuse
    factory = KVEndpointFactory("nixl", f"refused-{uuid.uuid4().hex[:8]}")

    source = resolve_model_source(gqa[0])
    # The rank of DP rank 1 (of 2) attaches, is named by its place in the engine group, and a
    # read into DP rank 0's pool moves nothing on it (DP rank 0's ranks read those blocks).
    dp_runner = ModelRunner(resolved(source), source, pack_weights=False, parallel=ParallelLayout(dp_size=2, dp_rank=1))
    dp_runner.kv.attach(factory)
    try:
        assert (dp_runner.kv.rank, dp_runner.kv.dp_rank) == (1, 1)
        assert dp_runner.kv.dp_peer(1) == (factory.name, dp_runner.kv.metadata())
        assert dp_runner.kv.start_read("nobody", [0], [0], READ_TIMEOUT_S, dp_rank=0).result(timeout=5) == 0
        with pytest.raises(ValueError, match="serves DP rank 1, not dp_rank=0"):
            dp_runner.kv.dp_peer(0)
    finally:
        dp_runner.kv.detach()

    save_tiny_deepseek_v2(tmp_path)
    source = resolve_model_source(str(tmp_path))
    # DCP rank 1 of 2: its endpoint reads the odd tokens of every logical block.
    layout = ParallelLayout(tp_size=2, tp_rank=1, dcp_size=2, dcp_rank=1, comms={"dcp": Communicator.single()})
    dcp_runner = ModelRunner(resolved(source, tp_size=2, dcp_size=2), source, pack_weights=False, parallel=layout)
    dcp_runner.kv.attach(KVEndpointFactory("nixl", f"dcp-{uuid.uuid4().hex[:8]}"))
    try:
        assert dcp_runner.kv.token_shard == (1, 2)
        assert pickle.loads(dcp_runner.kv.metadata()[0])["token_shard"] == (1, 2)
    finally:
        dcp_runner.kv.detach()


def test_kv_attach_once_and_shutdown_closes_the_endpoint(gqa):
    runner = make_engine(gqa[0]).runner
    with pytest.raises(RuntimeError, match="rank 0: no KV endpoint attached; call kv.attach"):
        runner.kv.read("peer", [0], [0], READ_TIMEOUT_S)
    runner.kv.attach(KVEndpointFactory("nixl", f"once-{uuid.uuid4().hex[:8]}"))
    with pytest.raises(RuntimeError, match="already attached"):
        runner.kv.attach(KVEndpointFactory("nixl", f"twice-{uuid.uuid4().hex[:8]}"))
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        runner.kv.set_fail_next_reads(-1)
    with pytest.raises(ValueError, match="seconds must be a non-negative number"):
        runner.kv.set_delay_next_reads(-1.0)
    assert runner.kv.metadata()[0] and runner.kv.peer_id.startswith("once-")
    runner.shutdown()
    assert not runner.kv.attached
    with pytest.raises(RuntimeError, match="kv.attach"):
        runner.kv.metadata()
    # Detached, it may attach a fresh endpoint.
    runner.kv.attach(KVEndpointFactory("nixl", f"again-{uuid.uuid4().hex[:8]}"))
    runner.shutdown()


def test_the_port_reads_on_its_own_thread(gqa):
    """``start_read`` returns at once; the read (delayed by the seam, then a real NIXL READ
    between two in-process runners) ends on the port's thread; a delay past the timeout fails
    the read, naming the rank; a detach cancels what has not started."""
    path, _ = gqa
    prefiller, decoder = make_engine(path), make_engine(path)
    with attached("nixl", prefiller, decoder) as (prefill_id, _):
        ticket = ticket_for(prefiller, prefill_id, random_prompts([33], 256, seed=71)[0])
        port = decoder.runner.kv
        port.set_delay_next_reads(0.5)
        started = time.monotonic()
        read = port.start_read(prefill_id, ticket.block_ids, [4, 5, 6], READ_TIMEOUT_S, prefiller.runner.kv.metadata())
        assert time.monotonic() - started < 0.25 and not read.done()
        block_bytes = decoder.runner.kv_layout.block_size * decoder.runner.kv_layout.bytes_per_token
        assert read.result(timeout=10) == 3 * block_bytes and time.monotonic() - started >= 0.5
        port.set_delay_next_reads(2.0)
        with pytest.raises(KVRankError, match="rank 0.*did not finish within 0.3 s"):
            port.start_read(prefill_id, ticket.block_ids, [4, 5, 6], 0.3).result(timeout=10)
        port.set_delay_next_reads(1.0)
        slow, queued = (port.start_read(prefill_id, ticket.block_ids, [4, 5, 6], READ_TIMEOUT_S) for _ in range(2))
        release_prefill(prefiller, ticket)
    assert slow.done() and queued.cancelled()  # NOTE: the detach waited for the read in flight
    prefiller.runner.shutdown()
    decoder.runner.shutdown()
