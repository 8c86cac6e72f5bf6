"""The scheduler tests' stand-in for the model runner, and their step helpers.

No model: :class:`FakeRunner` writes each new token's id into its KV slot, reads every
request's context back from the slots it is told to attend to, and "samples" a
deterministic function of that context. A wrong block table, a shared block
overwritten, or a bad recompute therefore changes the outputs, which are
checked against the same function applied to the true token sequence
(:func:`helpers.prompts.reference_outputs`).
"""

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from helpers.prompts import ORACLE_VOCAB, next_token


class FakeRunner:
    """Stands in for the model runner over a paged cache of token ids."""

    def __init__(self, pool: KVBlockPool) -> None:
        self.pool = pool
        self.slots: list[int | None] = [None] * (pool.num_blocks * pool.block_size)

    def _slot(self, request: Request, position: int) -> int:
        size = self.pool.block_size
        return request.block_ids[position // size] * size + position % size

    def execute(self, output: SchedulerOutput) -> dict[str, int | None]:
        sampled: dict[str, int | None] = {}
        for item in output.scheduled:
            request = item.request
            context = [self._slot_value(request, p) for p in range(item.start_position)]
            assert context == request.all_token_ids[: item.start_position], f"{request}: cache holds wrong context"
            for offset, token in enumerate(item.token_ids):
                slot = self._slot(request, item.start_position + offset)
                # NOTE: a block another live request references must never be written.
                assert self.pool.ref_count(slot // self.pool.block_size) == 1, f"{request} writes a shared block"
                self.slots[slot] = token
            sampled[request.request_id] = next_token(context + item.token_ids) if item.samples else None
        return sampled

    def _slot_value(self, request: Request, position: int) -> int | None:
        return self.slots[self._slot(request, position)]


def make(num_blocks=64, block_size=4, **kwargs) -> tuple[Scheduler, FakeRunner]:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 64)
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kwargs))
    return scheduler, FakeRunner(scheduler.pool)


def check_output(scheduler: Scheduler, output: SchedulerOutput, waiting_before: set[str]) -> None:
    admitted = [item.request for item in output.scheduled if item.request.request_id in waiting_before]
    priority = scheduler.config.priority
    if priority is None:
        # NOTE: admitting right after a preemption would only thrash: nothing joins that step.
        assert not (output.preempted and admitted), f"admitted {admitted} in a step that preempted {output.preempted}"
    elif output.preempted and admitted:
        # NOTE: priority preemption: only a more urgent arrival preempts, and only less urgent ones.
        most_urgent = min(priority.urgency(r) for r in admitted)
        assert all(priority.urgency(r) > most_urgent for r in output.preempted), (admitted, output.preempted)
    for item in output.scheduled:
        assert len(item.request.block_ids) * scheduler.pool.block_size >= item.start_position + item.num_new_tokens


def step(scheduler: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One engine step; finishes requests at max_tokens like the engine does."""
    waiting_before = {request.request_id for request in scheduler.waiting}
    output = scheduler.schedule()
    check_output(scheduler, output, waiting_before)
    assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        blocks_needed = scheduler.pool.blocks_for_tokens(request.num_computed_tokens)
        assert len(request.block_ids) >= blocks_needed
    for request in scheduler.update(output, runner.execute(output)):
        if request.reached_max_tokens:
            assert scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
    scheduler.check_invariants()
    return output


def shares(output: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {item.request.request_id: (item.start_position, item.num_new_tokens) for item in output.scheduled}


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished():
        step(scheduler, runner)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def random_request(rng, scheduler: Scheduler, prefixes: list[list[int]], request_id: str) -> Request:
    """A request for the random-mix tests: one of ``prefixes`` plus 1-7 random tokens, and a
    ``max_tokens`` of 1-30 that fits what one request may use."""
    prompt = rng.choice(prefixes) + [rng.randrange(ORACLE_VOCAB) for _ in range(rng.randrange(1, 8))]
    limit = scheduler.max_tokens_per_request() - len(prompt)
    return Request(request_id, prompt, max_tokens=rng.randrange(1, min(limit, 30) + 1))
