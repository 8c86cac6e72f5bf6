"""Request migration (flotilla.serve.migration) over a scripted engine client: what a cut
stream gives the client, what the next replica is sent, and where migration stops."""

import asyncio

import pytest

from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.serve.migration import migrating
from flotilla.serve.types import CompletionChunk, GenerateChunk, GenerateRequest, ReplicaLostError

FULL = list(range(100, 112))


def chunk(tokens, finish=None, index=0, **fields):
    return GenerateChunk("r", [CompletionChunk(index, list(tokens), " ".join(map(str, tokens)), finish_reason=finish)], **fields)


class Replicas:
    """A scripted engine client: each call to ``generate`` plays the next script, which
    lists chunks, or an exception raised where it stands; the requests it got are kept."""

    def __init__(self, *scripts):
        self.scripts, self.requests = list(scripts), []

    async def generate(self, request):
        self.requests.append(request)
        for item in self.scripts.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item


def lost_at(tokens_before, last_tokens):
    """A replica that streams ``tokens_before`` and dies with ``last_tokens`` pending (its
    last chunk: those tokens, finish ``error``, ``replica_failed``)."""
    return [chunk(tokens_before), chunk(last_tokens, "error", finished=True, error="engine died", replica_failed=True)]


def finish(tokens, completion_tokens):
    return [chunk(tokens[:1]), chunk(tokens[1:], "length", finished=True, prompt_tokens=3, completion_tokens=completion_tokens)]


def request(n=1):
    return GenerateRequest("r", [1, 2, 3], SamplingParams(n=n, max_tokens=len(FULL), temperature=0), 0.0, group_id="g", group_size=2)


def collect(stream):
    async def run():
        return [c async for c in stream]

    return asyncio.run(run())


def tokens_of(chunks):
    return [t for c in chunks for comp in c.completions for t in comp.token_ids]


def test_a_cut_stream_goes_on_at_another_replica_as_one_stream():
    # NOTE: the engine that resumes counts the resumed tokens among the request's outputs.
    replicas = Replicas(lost_at(FULL[:3], FULL[3:5]), finish(FULL[5:], completion_tokens=len(FULL)))
    counted = []
    chunks = collect(migrating(replicas.generate, request(), limit=1, on_migrate=lambda: counted.append(1)))
    assert tokens_of(chunks) == FULL and counted == [1]
    # The cut chunk's tokens reached the client, without its error or finish.
    assert all(c.error is None and not c.replica_failed for c in chunks)
    assert [comp.finish_reason for c in chunks for comp in c.completions] == [None, None, None, "length"]
    resumed = replicas.requests[1]
    assert resumed.resumed_token_ids == tuple(FULL[:5]) and resumed.prompt_token_ids == [1, 2, 3]
    # NOTE: alone at its new replica: it must not wait there for the rest of its HTTP request's prompts.
    assert (resumed.group_id, resumed.group_size) == (None, 1)
    assert chunks[-1].finished and chunks[-1].completion_tokens == len(FULL)


def test_a_stream_cut_by_the_actors_death_migrates_too():
    replicas = Replicas([chunk(FULL[:4]), ReplicaLostError("actor died")], finish(FULL[4:], completion_tokens=8))
    chunks = collect(migrating(replicas.generate, request(), limit=1))
    assert tokens_of(chunks) == FULL and replicas.requests[1].resumed_token_ids == tuple(FULL[:4])


def test_with_migration_off_or_spent_the_cut_reaches_the_client():
    cut = lost_at(FULL[:3], FULL[3:5])
    chunks = collect(migrating(Replicas(cut).generate, request(), limit=0))
    assert chunks[-1].error == "engine died" and chunks[-1].completions[0].finish_reason == "error"
    replicas = Replicas(lost_at(FULL[:2], FULL[2:3]), lost_at(FULL[3:5], FULL[5:6]))
    chunks = collect(migrating(replicas.generate, request(), limit=1))
    assert chunks[-1].replica_failed and chunks[-1].completions[0].finish_reason == "error"
    assert tokens_of(chunks) == FULL[:6]


def test_a_request_with_several_completions_is_not_migrated():
    replicas = Replicas([chunk(FULL[:2]), ReplicaLostError("actor died")])
    with pytest.raises(ReplicaLostError, match="actor died"):
        collect(migrating(replicas.generate, request(n=2), limit=3))
    assert len(replicas.requests) == 1


def test_errors_of_the_request_itself_are_not_migrated():
    own = chunk(FULL[:1], "error", finished=True, error="grammar refused the token")  # NOTE: not replica_failed
    chunks = collect(migrating(Replicas([own]).generate, request(), limit=1))
    assert chunks[-1].error == "grammar refused the token"
    replicas = Replicas([ValueError("prompt: too long")])
    with pytest.raises(ValueError, match="too long"):
        collect(migrating(replicas.generate, request(), limit=1))
    assert len(replicas.requests) == 1


def test_a_completion_the_lost_replica_finished_is_not_resent():
    done = chunk(FULL, "length", finished=True, error="engine died", replica_failed=True, completion_tokens=len(FULL))
    chunks = collect(migrating(Replicas([done]).generate, request(), limit=1))
    assert tokens_of(chunks) == FULL and chunks[-1].completions[0].finish_reason == "length"


def test_a_migration_waits_for_a_live_replica_with_backoff_then_gives_up(monkeypatch):
    sleeps = []

    async def no_sleep(seconds):
        sleeps.append(seconds)

    monkeypatch.setattr("flotilla.serve.migration.asyncio.sleep", no_sleep)
    now = [0.0]

    def clock():
        now[0] += 1.0  # NOTE: every look at the clock is a second later
        return now[0]

    refused = [ReplicaLostError("no replica")]
    # Cut, then two refused resubmissions, then a replica takes it.
    replicas = Replicas(lost_at(FULL[:1], FULL[1:2]), refused, refused, finish(FULL[2:], completion_tokens=10))
    chunks = collect(migrating(replicas.generate, request(), limit=1, wait_s=10, clock=clock))
    assert tokens_of(chunks) == FULL and sleeps == [0.25, 0.5]
    assert all(r.resumed_token_ids == tuple(FULL[:2]) for r in replicas.requests[1:])
    # Never a replica within the bound: the client gets the error that says so.
    replicas = Replicas(lost_at(FULL[:1], FULL[1:2]), *[refused] * 20)
    with pytest.raises(ReplicaLostError, match=r"found no live engine replica within 3 s"):
        collect(migrating(replicas.generate, request(), limit=1, wait_s=3, clock=clock))
    assert len(replicas.requests) < 6


def test_a_migration_held_by_serve_without_a_replica_gives_up_at_its_bound():
    """Serve holds a call while the deployment has no live replica (its only one died): the
    resubmission's wait for its first chunk is bounded by the migration's wait."""

    class Held(Replicas):
        async def generate(self, request):
            if self.scripts:
                async for item in super().generate(request):
                    yield item
                return
            self.requests.append(request)
            await asyncio.sleep(60)
            yield chunk([0])

    replicas = Held(lost_at(FULL[:2], FULL[2:3]))
    with pytest.raises(ReplicaLostError, match=r"found no live engine replica within 0.2 s"):
        collect(migrating(replicas.generate, request(), limit=1, wait_s=0.2))
    assert len(replicas.requests) == 2
