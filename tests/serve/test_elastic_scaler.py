"""Elastic EP's serving pieces over a fake engine (a join that takes as long as the test says,
then succeeds or raises the cluster's ``ElasticJoinError``), without Ray: the scaler (one scale
at a time, 400/409/500), the autoscaler's driver fed injected load samples, the admin routes
and the elastic metrics. The same pieces run live in test_elastic_ep_live.py and
test_elastic_ep_faults_live.py.

Oracles: the policy's own decisions on the same samples; prometheus_client's parser."""

from __future__ import annotations

import asyncio
import logging
import pickle

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.cluster.elastic import ElasticJoinError, JoinReport
from flotilla.serve.elastic_ep import (
    ElasticEPPlan,
    ElasticEPScaler,
    ScaleFailedError,
    ScaleInProgressError,
    ScaleRequestError,
)
from flotilla.serve.ep_autoscale_driver import ElasticEPAutoscaleDriver, p90
from flotilla.serve.ingress import create_app
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.types import ElasticAutoscaleOptions, EngineUnavailableError, ReplicaLoad, ServeOptions
from helpers.resolution_configs import default_cpu_config


# -- the scaler over a fake engine -----------------------------------------------------------


class FakeEngine:
    """``ep_size``, ``grow_elastic_ep`` (waits for ``release`` when set, then succeeds or
    raises ``fail``), ``load()``, ``dp_rank_requests()`` and real metrics."""

    def __init__(self, ep_size: int = 1):
        self.ep_size = ep_size
        self.release: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.grows: list[tuple[object, int, float]] = []
        self.metrics = EngineMetrics("fake")
        self.requests = [0] * ep_size
        self.load_now = ReplicaLoad()

    async def grow_elastic_ep(self, joiner_config, new_size: int, timeout_s: float) -> JoinReport:
        self.grows.append((joiner_config, new_size, timeout_s))
        if self.release is not None:
            await self.release.wait()
        if self.fail is not None:
            raise self.fail
        old, self.ep_size = self.ep_size, new_size
        self.requests += [0] * (new_size - old)
        return JoinReport(old, new_size, prepare_s=0.5, commit_pause_s=0.02, total_s=0.6)

    def dp_rank_requests(self) -> list[int]:
        return list(self.requests)

    def load(self) -> ReplicaLoad:
        return self.load_now


PLAN = ElasticEPPlan(
    initial_size=1, max_ep_size=3, scale_timeout_s=7.0,
    joiner_configs={(1, 2): "join-1-2", (1, 3): "join-1-3", (2, 3): "join-2-3"},
)  # fmt: skip


def scaler_for(engine: FakeEngine) -> tuple[ElasticEPScaler, list]:
    metrics = engine.metrics.enable_elastic_ep(lambda: engine.ep_size)
    engine.metrics.enable_dp_rank_requests(engine.dp_rank_requests)
    scaler = ElasticEPScaler(engine, PLAN, metrics)
    outcomes: list = []
    scaler.add_outcome_listener(lambda ok, t: outcomes.append(ok))
    return scaler, outcomes


def sample(engine: FakeEngine, name: str, **labels) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(engine.metrics.exposition())
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_scale_grows_with_the_planned_joiner_and_reports_its_timings():
    engine = FakeEngine()
    scaler, outcomes = scaler_for(engine)

    result = asyncio.run(scaler.scale_to(2))
    assert engine.grows == [("join-1-2", 2, 7.0)]
    assert (result["old_ep_size"], result["new_ep_size"]) == (1, 2) and "from 1 to 2" in result["message"]
    assert (result["prepare_s"], result["commit_pause_s"], result["total_s"]) == (0.5, 0.02, 0.6)
    assert result["scale_s"] >= 0
    assert scaler.state() == {"ep_size": 2, "max_ep_size": 3, "initial": 1, "scaling": False, "last_error": None}
    assert outcomes == [True]
    assert sample(engine, "flotilla:ep_size") == 2
    assert sample(engine, "flotilla:ep_scale_total", outcome="success") == 1
    assert sample(engine, "flotilla:ep_scale_total", outcome="failure") == 0
    assert sample(engine, "flotilla:ep_scale_seconds_count") == 1
    assert sample(engine, "flotilla:ep_commit_pause_seconds_bucket", le="0.025") == 1
    asyncio.run(scaler.scale_to(3))
    assert engine.grows[-1] == ("join-2-3", 3, 7.0)


@pytest.mark.parametrize(
    "value, words",
    [
        ("x", "new_ep_size must be an integer (got new_ep_size='x')"),
        (True, "new_ep_size must be an integer"),
        (2.0, "new_ep_size must be an integer"),
        (0, "new_ep_size must be at least 1 (got new_ep_size=0)"),
        (4, "new_ep_size=4 exceeds this deployment's max_ep_size=3"),
        (2, "new_ep_size=2 is not above the current ep_size=2: elastic EP only grows (no scale-down)"),
        (1, "no scale-down"),
    ],
)
def test_a_bad_size_is_a_400_naming_new_ep_size_and_starts_nothing(value, words):
    engine = FakeEngine(ep_size=2)
    scaler, outcomes = scaler_for(engine)
    with pytest.raises(ScaleRequestError) as err:
        asyncio.run(scaler.scale_to(value))
    assert words in str(err.value) and err.value.status == 400 and err.value.param == "new_ep_size"
    assert engine.grows == [] and outcomes == [] and not scaler.is_scaling
    assert sample(engine, "flotilla:ep_scale_total") == 0


def test_a_second_scale_while_one_runs_is_a_409_and_the_flag_spans_the_whole_scale():
    engine = FakeEngine()
    engine.release = asyncio.Event()
    scaler, outcomes = scaler_for(engine)

    async def main():
        first = asyncio.ensure_future(scaler.scale_to(2))
        await asyncio.sleep(0)
        assert scaler.is_scaling and scaler.state()["scaling"]
        with pytest.raises(ScaleInProgressError) as err:
            await scaler.scale_to(3)
        assert err.value.status == 409 and "already running" in str(err.value)
        engine.release.set()
        await first
        assert not scaler.is_scaling

    asyncio.run(main())
    assert len(engine.grows) == 1 and outcomes == [True]


def test_a_failed_join_is_a_500_that_keeps_the_old_size_logged_and_counted(caplog):
    engine = FakeEngine()
    engine.fail = ElasticJoinError("joiner rank 1 died while loading its experts")
    scaler, outcomes = scaler_for(engine)
    caplog.set_level(logging.ERROR, logger="flotilla.serve.elastic_ep")
    with pytest.raises(ScaleFailedError) as err:
        asyncio.run(scaler.scale_to(2))
    message = str(err.value)
    assert err.value.status == 500 and "joiner rank 1 died" in message and "keeps serving at ep_size=1" in message
    assert pickle.loads(pickle.dumps(err.value)).status == 500  # NOTE: crosses the Serve handle
    assert not scaler.is_scaling and scaler.ep_size == 1 and outcomes == [False]
    assert scaler.last_error == "joiner rank 1 died while loading its experts"
    assert sample(engine, "flotilla:ep_scale_total", outcome="failure") == 1
    assert sample(engine, "flotilla:ep_scale_seconds_count") == 0
    assert any(r.levelno == logging.ERROR and "joiner rank 1 died" in r.getMessage() for r in caplog.records)

    engine.fail = EngineUnavailableError("the engine is dead: worker 0 died")
    with pytest.raises(ScaleFailedError) as err:
        asyncio.run(scaler.scale_to(2))
    assert err.value.status == 503 and "worker 0 died" in str(err.value)

    engine.fail = None  # NOTE: the next scale works, and clears last_error
    asyncio.run(scaler.scale_to(2))
    assert scaler.last_error is None and outcomes == [False, False, True]


def test_a_caller_that_leaves_does_not_cancel_the_scale():
    engine = FakeEngine()
    engine.release = asyncio.Event()
    scaler, outcomes = scaler_for(engine)

    async def main():
        caller = asyncio.ensure_future(scaler.scale_to(2))
        await asyncio.sleep(0)
        caller.cancel()
        await asyncio.sleep(0)
        assert scaler.is_scaling
        engine.release.set()
        for _ in range(100):
            if not scaler.is_scaling:
                break
            await asyncio.sleep(0)

    asyncio.run(main())
    assert scaler.ep_size == 2 and outcomes == [True]


# -- the autoscaler's driver -----------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def driver_for(engine: FakeEngine, clock: Clock, **policy) -> tuple[ElasticEPAutoscaleDriver, ElasticEPScaler]:
    scaler, _ = scaler_for(engine)
    scaler.clock = clock
    values = dict(waiting_per_rank_threshold=4.0, kv_usage_threshold=0.85, ttft_p90_threshold_s=None,
                  window_s=10.0, cooldown_s=30.0)  # fmt: skip
    options = ElasticAutoscaleOptions(enabled=True, interval_s=2.0, **{**values, **policy})
    return ElasticEPAutoscaleDriver(engine, scaler, options.policy(PLAN.max_ep_size), 2.0, clock=clock), scaler


def run_ticks(driver, clock: Clock, seconds: float, step: float = 2.0) -> list:
    decisions = []

    async def main():
        end = clock.now + seconds
        while clock.now < end:
            decision = await driver.tick()
            if decision is not None:
                decisions.append((clock.now, decision.new_ep_size))
            clock.now += step

    asyncio.run(main())
    return decisions


def test_sustained_queue_pressure_requests_exactly_one_join_and_light_load_none():
    engine, clock = FakeEngine(), Clock()
    driver, scaler = driver_for(engine, clock)
    engine.load_now = ReplicaLoad(running=4, waiting=1, kv_usage=0.3)
    assert run_ticks(driver, clock, 60) == [] and engine.grows == []

    engine.load_now = ReplicaLoad(running=8, waiting=9, kv_usage=0.5)  # 9 waiting on 1 rank > 4
    decisions = run_ticks(driver, clock, 20)  # NOTE: within the cooldown after the join
    assert [size for _, size in decisions] == [2] and scaler.ep_size == 2 and len(engine.grows) == 1
    # 9 waiting over 2 ranks is still above 4 per rank, but the cooldown holds the next join.
    assert decisions[0][0] - 60 >= 10.0


def test_a_scale_an_operator_runs_starts_the_cooldown_of_the_autoscaler():
    engine, clock = FakeEngine(), Clock()
    driver, scaler = driver_for(engine, clock, window_s=4.0)
    asyncio.run(scaler.scale_to(2))  # NOTE: POST /scale_elastic_ep, at t=0
    engine.load_now = ReplicaLoad(running=8, waiting=20, kv_usage=0.5)
    assert run_ticks(driver, clock, 28) == []
    assert [size for _, size in run_ticks(driver, clock, 10)] == [3]


def test_the_sample_carries_the_ttfts_since_the_previous_one():
    engine, clock = FakeEngine(), Clock()
    driver, _ = driver_for(engine, clock)
    for ttft in (0.1, 0.2, 3.0):
        engine.metrics.time_to_first_token.observe(ttft)
    first = driver.sample()
    assert first.ttft_p90_s == 3.0 and first.ep_size == 1 and not first.scaling
    assert driver.sample().ttft_p90_s is None  # nothing new since
    engine.metrics.time_to_first_token.observe(0.4)
    assert driver.sample().ttft_p90_s == 0.4
    assert p90([float(i) for i in range(1, 11)]) == 9.0 and p90([]) is None


def test_the_driver_task_stops_cleanly():
    engine = FakeEngine()
    driver, _ = driver_for(engine, Clock())

    async def main():
        task = driver.start()
        assert driver.start() is task  # idempotent
        await asyncio.sleep(0)
        driver.stop()
        with pytest.raises(asyncio.CancelledError):
            await task
        driver.stop()

    asyncio.run(main())


# -- the admin routes ------------------------------------------------------------------------


class StubElasticClient:
    """The ingress's engine client of an elastic deployment (the replica's admin methods)."""

    def __init__(self, scaler: ElasticEPScaler):
        self.scaler = scaler

    async def scale_elastic_ep(self, new_ep_size):
        return await self.scaler.scale_to(new_ep_size)

    async def is_scaling_elastic_ep(self) -> bool:
        return self.scaler.is_scaling

    async def elastic_ep_state(self) -> dict:
        return self.scaler.state()


def admin_app(engine: FakeEngine, plan=PLAN, api_key=None):
    scaler, _ = scaler_for(engine)
    options = ServeOptions(served_model_name="moe", elastic_plan=plan, api_key=api_key)
    return scaler, create_app(StubElasticClient(scaler), None, options, default_cpu_config())


def http(app, **headers) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flotilla.test", headers=headers)


def envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_the_admin_routes_answer_in_vllm_and_sglang_shapes():
    engine = FakeEngine()
    engine.release = asyncio.Event()
    scaler, app = admin_app(engine)

    async def main():
        client = http(app)
        assert (await client.get("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": False}
        card = (await client.get("/v1/models")).json()["data"][0]
        assert (card["id"], card["ep_size"], card["max_ep_size"]) == ("moe", 1, 3)

        error = envelope(await client.post("/scale_elastic_ep", json={"new_ep_size": 4}), 400)
        assert error["param"] == "new_ep_size" and "max_ep_size=3" in error["message"]
        assert "new_ep_size='x'" in envelope(await client.post("/scale_elastic_ep", json={"new_ep_size": "x"}), 400)["message"]
        assert "needs new_ep_size" in envelope(await client.post("/scale_elastic_ep", json={}), 400)["message"]
        assert "disagree" in envelope(
            await client.post("/scale_elastic_ep", json={"new_ep_size": 2, "new_data_parallel_size": 3}), 400
        )["message"]
        envelope(await client.post("/scale_elastic_ep", json=[2]), 400)

        scaling = asyncio.ensure_future(client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2}))
        for _ in range(200):
            if scaler.is_scaling:
                break
            await asyncio.sleep(0.01)
        assert (await client.post("/is_scaling_elastic_ep")).json() == {"is_scaling_elastic_ep": True}
        conflict = envelope(await client.post("/scale_elastic_ep", json={"new_ep_size": 3}), 409)
        assert conflict["code"] == "elastic_ep_scale_in_progress"
        engine.release.set()
        done = await scaling
        assert done.status_code == 200 and done.json()["new_ep_size"] == 2
        assert (await client.get("/v1/models")).json()["data"][0]["ep_size"] == 2

        engine.release, engine.fail = None, ElasticJoinError("placement group not granted within 7 s")
        failed = envelope(await client.post("/scale_elastic_ep", json={"new_ep_size": 3}), 500)
        assert "placement group not granted" in failed["message"] and "ep_size=2" in failed["message"]
        assert failed["type"] == "server_error"

    asyncio.run(main())


def test_the_admin_routes_are_404_when_not_elastic_and_need_the_api_key():
    engine = FakeEngine()

    async def main():
        _, plain = admin_app(engine, plan=None)
        client = http(plain)
        error = envelope(await client.post("/scale_elastic_ep", json={"new_ep_size": 2}), 404)
        assert "not elastic" in error["message"] and "--max-ep-size" in error["message"]
        envelope(await client.get("/is_scaling_elastic_ep"), 404)
        assert "ep_size" not in (await client.get("/v1/models")).json()["data"][0]

        _, keyed = admin_app(FakeEngine(), api_key="sesame")
        envelope(await http(keyed).get("/is_scaling_elastic_ep"), 401)
        envelope(await http(keyed).post("/scale_elastic_ep", json={"new_ep_size": 2}), 401)
        ok = await http(keyed, Authorization="Bearer sesame").get("/is_scaling_elastic_ep")
        assert ok.json() == {"is_scaling_elastic_ep": False}
        assert engine.grows == []

    asyncio.run(main())


# -- the elastic metrics ---------------------------------------------------------------------


def test_the_elastic_metrics_carry_the_replica_and_pool_labels_and_read_the_engine_live():
    engine = FakeEngine(ep_size=2)
    scaler_for(engine)
    engine.requests = [5, 3]
    families = {f.name: f for f in text_string_to_metric_families(engine.metrics.exposition())}
    kinds = {"flotilla:ep_size": "gauge", "flotilla:ep_scale": "counter", "flotilla:ep_scale_seconds": "histogram",
             "flotilla:ep_commit_pause_seconds": "histogram", "flotilla:dp_rank_requests": "counter"}  # fmt: skip
    for name, kind in kinds.items():
        assert families[name].type == kind, name
        assert all(s.labels["replica"] == "fake" and s.labels["pool"] == "colocated" for s in families[name].samples)
    assert sample(engine, "flotilla:dp_rank_requests_total", dp_rank="0") == 5
    assert sample(engine, "flotilla:dp_rank_requests_total", dp_rank="1") == 3
    engine.requests, engine.ep_size = [5, 3, 4], 3
    assert sample(engine, "flotilla:dp_rank_requests_total", dp_rank="2") == 4
    assert sample(engine, "flotilla:ep_size") == 3
    assert "flotilla:ep_size" not in EngineMetrics("plain").exposition()  # only elastic replicas have them
