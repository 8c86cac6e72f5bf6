"""The host tier of the prefix cache (``--enable-hierarchical-cache``): the slot index, the
scheduler's offloads at preemption and loads at re-admission, the sizing rules, and the real
engine's greedy tokens with the tier on.

The scheduler tests run test_scheduler.py's fake runner (each token's id written into its KV
slot, every request's context read back from the slots it attends to) with a host memory of
token slots: a copy to or from the wrong slot, a block loaded into the wrong place, or a
recompute skipped for a block the tier never held changes the context, which the runner
checks against the true token sequence, and the outputs, checked against the reference.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.host_kv_tier import GB, HostKVTier, host_kv_blocks
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import SchedulerConfig
from helpers.prompts import ORACLE_VOCAB, reference_outputs
from helpers.scheduler_harness import FakeRunner, check_output, make, random_request, run_to_completion, shares, step
from helpers.margins import ENGINE_MIN_LEAD
from helpers.tiny_models import hf_greedy, save_tiny_llama
from helpers.torch_threads import one_intra_op_thread


class HostFakeRunner(FakeRunner):
    """The fake runner plus a host memory of ``num_slots`` blocks of token ids."""

    def __init__(self, pool, num_slots: int) -> None:
        super().__init__(pool)
        self.host: list[list[int | None]] = [[None] * pool.block_size for _ in range(num_slots)]
        self.offloaded = self.loaded = 0

    def execute(self, output):
        size = self.pool.block_size
        for block, slot in output.kv_offload:
            self.host[slot] = self.slots[block * size : (block + 1) * size]
        for slot, block in output.kv_load:
            self.slots[block * size : (block + 1) * size] = self.host[slot]
        self.offloaded += len(output.kv_offload)
        self.loaded += len(output.kv_load)
        return super().execute(output)


def make_tiered(num_host_blocks: int, **kwargs):
    scheduler, _ = make(num_host_blocks=num_host_blocks, **kwargs)
    return scheduler, HostFakeRunner(scheduler.pool, num_host_blocks)


# ---- the slot index --------------------------------------------------------------------------


def test_slots_are_reused_least_recently_used_first_and_a_stored_key_is_not_copied_again():
    tier = HostKVTier(2)
    assert tier.store("a") == 0 and tier.store("b") == 1
    assert tier.store("a") is None  # already there: now the most recently used
    assert tier.store("c") == 1  # evicts b, the least recently used
    assert "b" not in tier and tier.lookup("c") == 1 and tier.lookup("b") is None
    assert tier.take(["a"]) == [0] and tier.loaded_blocks == 1
    assert tier.store("d") == 1  # c is older than the just-loaded a
    assert (tier.stored_blocks, len(tier)) == (4, 2)
    tier.check_invariants()
    tier.clear()
    assert len(tier) == 0 and tier.store("e") == 0
    tier.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_slot_count_names_the_parameter(bad):
    with pytest.raises(ValueError, match="num_slots"):
        HostKVTier(bad)


def test_scheduler_config_checks_the_host_blocks():
    with pytest.raises(ValueError, match="num_host_blocks must be an integer >= 0"):
        SchedulerConfig(num_blocks=8, num_host_blocks=-1)
    with pytest.raises(ValueError, match="num_host_blocks=4 needs enable_prefix_caching=True"):
        SchedulerConfig(num_blocks=8, num_host_blocks=4, enable_prefix_caching=False)


# ---- the scheduler ----------------------------------------------------------------------------


def run_a_and_b(scheduler, runner):
    """Two 9-token prompts in a 6-block pool of 4-token blocks: at position 12 a needs a 4th
    block and b, the latest arrival, is preempted with 12 tokens computed (3 full committed
    blocks); a then grows to 5 blocks, evicting two of b's blocks from the GPU prefix cache
    (the later ones go first). Returns the preempting step's output and b's re-admission's."""
    a = Request("a", [1] * 9, max_tokens=10)
    b = Request("b", [2] * 9, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    preempted = step_until_preempted(scheduler, runner)
    assert preempted.preempted == [b] and len(b.output_token_ids) == 4
    while a.status is RequestStatus.RUNNING:
        assert b not in [item.request for item in step(scheduler, runner).scheduled]
    resumed = step(scheduler, runner)
    run_to_completion(scheduler, runner)
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 10)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 8)
    return preempted, resumed


def step_until_preempted(scheduler, runner, max_steps=50):
    for _ in range(max_steps):
        output = step(scheduler, runner)
        if output.preempted:
            return output
    raise AssertionError("no preemption")


def test_a_preempted_request_loads_its_blocks_back_instead_of_recomputing_them():
    scheduler, runner = make_tiered(8, num_blocks=6, block_size=4)
    preempted, resumed = run_a_and_b(scheduler, runner)
    # b's blocks 3, 4, 5 (its 12 computed tokens) go to host slots 0-2 before a reuses them.
    assert preempted.kv_offload == [(3, 0), (4, 1), (5, 2)] and not preempted.kv_load
    # Block 3 is still in the GPU cache; the two a took come back from slots 1 and 2: only the
    # newest token is computed.
    assert shares(resumed) == {"b": (12, 1)}
    assert [slot for slot, _ in resumed.kv_load] == [1, 2] and not resumed.kv_offload
    assert (runner.offloaded, runner.loaded, scheduler.host_tier.loaded_blocks) == (3, 2, 2)


def test_without_the_tier_the_same_request_recomputes_what_the_gpu_cache_lost():
    """The control: the same workload with no host tier recomputes 9 of b's 13 tokens."""
    scheduler, runner = make(num_blocks=6, block_size=4)
    preempted, resumed = run_a_and_b(scheduler, runner)
    assert not preempted.kv_offload and shares(resumed) == {"b": (4, 9)}


def test_a_later_request_with_the_same_prefix_loads_it_from_the_host():
    """b is preempted (its 3 blocks offloaded) and then aborted, so only the tier remembers its
    prompt; c, a later request starting with b's first 8 prompt tokens, finds block 0 still in
    the GPU cache and block 1 (evicted there by a's growth) in the host tier."""
    scheduler, runner = make_tiered(8, num_blocks=6, block_size=4)
    a = Request("a", [1] * 9, max_tokens=10)
    b = Request("b", [2] * 9, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    step_until_preempted(scheduler, runner)
    assert scheduler.abort("b")
    while a.status is RequestStatus.RUNNING:
        step(scheduler, runner)
    c = Request("c", [2] * 8 + [5, 6], max_tokens=2)
    scheduler.add(c)
    admitted = step(scheduler, runner)
    assert shares(admitted) == {"c": (8, 2)} and [slot for slot, _ in admitted.kv_load] == [1]
    assert c.num_cached_prompt_tokens == 8  # reported as cached prompt tokens (OpenAI usage)
    run_to_completion(scheduler, runner)
    assert c.output_token_ids == reference_outputs(c.prompt_token_ids, 2)


@pytest.mark.parametrize("host_blocks", [2, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_with_a_host_tier_keeps_every_output_and_leaks_nothing(host_blocks, seed):
    rng = random.Random(seed)
    scheduler, runner = make_tiered(host_blocks, num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    prefixes = [[rng.randrange(ORACLE_VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    requests = []
    for index in range(150):
        if rng.random() < 0.4:
            request = random_request(rng, scheduler, prefixes, f"r{index}")
            scheduler.add(request)
            requests.append(request)
        if requests and rng.random() < 0.03:
            scheduler.abort(rng.choice(requests).request_id)
        waiting_before = {request.request_id for request in scheduler.waiting}
        output = scheduler.schedule()
        check_output(scheduler, output, waiting_before)
        assert not (output.kv_offload and output.kv_load), "a step both offloads and loads"
        for request in scheduler.update(output, runner.execute(output)):
            if request.reached_max_tokens:
                scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        scheduler.check_invariants()
    run_to_completion(scheduler, runner)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    assert scheduler.num_preemptions > 0 and runner.offloaded > 0 and runner.loaded > 0
    for request in requests:
        if request.status is not RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)


# ---- sizing --------------------------------------------------------------------------------------


def _config(**overrides):
    base = dict(enable_hierarchical_cache=True, disable_radix_cache=False, hicache_storage_backend=None,
                hicache_host_memory_mode="cache", hicache_size=0, hicache_ratio=2.0)  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


def test_host_blocks_from_the_size_or_the_ratio():
    assert host_kv_blocks(_config(enable_hierarchical_cache=False), 1000, 10) == 0
    assert host_kv_blocks(_config(), 1000, 10) == 20  # hicache_ratio 2.0 x 10 GPU blocks
    assert host_kv_blocks(_config(hicache_ratio=0.5), 1000, 10) == 5
    assert host_kv_blocks(_config(hicache_size=1), 2**20, 10) == GB // 2**20  # hicache_size wins


def test_bad_host_tier_settings_name_the_flag():
    with pytest.raises(ValueError, match="drop --disable-radix-cache"):
        host_kv_blocks(_config(disable_radix_cache=True), 1000, 10)
    with pytest.raises(NotImplementedError, match="hicache_storage_backend='file'"):
        host_kv_blocks(_config(hicache_storage_backend="file"), 1000, 10)
    with pytest.raises(NotImplementedError, match="hicache_host_memory_mode='buffer_only'"):
        host_kv_blocks(_config(hicache_host_memory_mode="buffer_only"), 1000, 10)
    with pytest.raises(ValueError, match="hicache_ratio=0.01 x 10 GPU blocks holds no KV block"):
        host_kv_blocks(_config(hicache_ratio=0.01), 1000, 10)
    with pytest.raises(ValueError, match=r"hicache_size=100000 GB asks for .* GB of host memory .* lower --hicache-size"):
        host_kv_blocks(_config(hicache_size=100_000), 2**20, 10)


# ---- the real engine ----------------------------------------------------------------------------


NEW_TOKENS = 40
PROMPT_LENS = (5, 17, 33, 60)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-host-tier")
    with one_intra_op_thread():
        model = save_tiny_llama(path)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENS]
        expected = [hf_greedy(model, prompt, NEW_TOKENS, min_lead=ENGINE_MIN_LEAD) for prompt in prompts]
    return path, prompts, expected


@pytest.mark.parametrize("ratio", [2.0, 0.5])
def test_engine_with_a_host_tier_preempts_loads_and_still_equals_hf(tiny_llama, ratio):
    """test_llm's tiny pool (8 blocks: the four requests do not fit together), with the host
    tier at twice the pool (every offload kept) and at half of it (LRU evictions)."""
    path, prompts, expected = tiny_llama
    with one_intra_op_thread():
        llm = LLM(str(path), max_total_tokens=128, enable_hierarchical_cache=True, hicache_ratio=ratio)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    engine = llm.engine
    assert engine.runner.kv_layout.host_blocks == int(ratio * 8) == engine.runner.host_kv.num_slots
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and stats["host_kv_stored_blocks"] > 0
    assert stats["host_kv_loaded_blocks"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.pool.num_used_blocks == 0
