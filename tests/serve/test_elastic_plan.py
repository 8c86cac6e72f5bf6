"""Elastic EP on the serve side, without Ray: the joiners' plan resolved for real (a tiny
Qwen3-MoE config, the CPU platform) and its refusals; the scaler, the autoscaler's driver,
the admin routes and the elastic metrics over a fake engine (a join that takes as long as
the test says, succeeds or raises the cluster's ``ElasticJoinError``).

Oracles: the joiner resolved directly from SGLang's joiner flags (the contract's example
command); the policy's own decisions on the same samples; prometheus_client's parser."""

from __future__ import annotations

import asyncio
import logging
import pickle
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.cluster.elastic import ElasticJoinError, JoinReport
from flotilla.resolution import ArgumentError, ModelFacts, ResolutionError, ServerArgs, preset, resolve
from flotilla.serve.elastic_ep import (
    ElasticEPPlan,
    ElasticEPScaler,
    ScaleFailedError,
    ScaleInProgressError,
    ScaleRequestError,
    is_elastic,
    resolve_elastic_plan,
)
from flotilla.serve.ep_autoscale_driver import ElasticEPAutoscaleDriver, elastic_autoscale_options, p90
from flotilla.serve.ingress import create_app
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.types import ElasticAutoscaleOptions, EngineUnavailableError, ReplicaLoad, ServeOptions

from helpers.tiny_moe import save_tiny_qwen3_moe

ELASTIC = dict(
    tp_size=1, dp_size=1, ep_size=1, enable_dp_attention=True, enable_dp_lm_head=True,
    elastic_ep_backend="ray", disable_cuda_graph=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-elastic")
    save_tiny_qwen3_moe(path)
    return str(path)


@pytest.fixture(scope="module")
def cpu():
    return preset("cpu")


def primary(moe_dir, cpu, **fields):
    from flotilla.serve.app import resolve_for_serving

    given = {"model_path": moe_dir, **ELASTIC, **fields}
    return given, resolve_for_serving(given, cpu)[0]


# -- the plan, resolved for real -------------------------------------------------------------


def test_every_join_of_the_range_is_resolved_as_the_joiner_flags_say(moe_dir, cpu):
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    plan = resolve_elastic_plan(given, config, cpu)
    assert (plan.initial_size, plan.max_ep_size, plan.scale_timeout_s) == (1, 3, 600.0)
    assert sorted(plan.joiner_configs) == [(1, 2), (1, 3), (2, 3)]
    for (current, new), joiner in plan.joiner_configs.items():
        k = new - current
        assert (joiner.tp_size, joiner.dp_size, joiner.ep_size) == (k, k, k)
        assert (joiner.ep_join_mode, joiner.node_rank, joiner.ep_join_rank_offset) == ("scale", 1, current)
        assert joiner.elastic_ep_initial_size == 1 and joiner.max_ep_size == 3
        # The oracle: SGLang's joiner flags on top of the user's, resolved directly.
        flags = dict(ELASTIC, max_ep_size=3, tp_size=k, dp_size=k, ep_size=k, ep_join_mode="scale", node_rank=1,
                     ep_join_rank_offset=current, elastic_ep_initial_size=1)  # fmt: skip
        if k == 1:
            flags["moe_dense_tp_size"] = 1
        from flotilla.cluster.models.sources import resolve_model_source

        facts = ModelFacts.from_hf_config(resolve_model_source(moe_dir).config_dict)
        assert joiner == resolve(ServerArgs.create(model_path=moe_dir, **flags), facts, cpu), (current, new)
    assert plan.joiner_configs[(1, 2)].moe_dense_tp_size == 1  # a one-rank joiner
    assert plan.joiner_config(2, 3) is plan.joiner_configs[(2, 3)]
    assert pickle.loads(pickle.dumps(plan)) == plan  # NOTE: it travels to the replica in ServeOptions


def test_the_platform_is_probed_once_for_every_joiner(moe_dir, cpu, monkeypatch):
    import flotilla.cluster.platform as platform

    calls = []
    monkeypatch.setattr(platform, "probe_for_workers", lambda: calls.append(1) or cpu)
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    assert len(resolve_elastic_plan(given, config).joiner_configs) == 3
    assert calls == [1]


def test_a_deployment_that_cannot_grow_has_no_plan(moe_dir, cpu):
    from flotilla.serve.app import resolve_for_serving

    plain = resolve_for_serving({"model_path": moe_dir}, cpu)[0]
    assert not is_elastic(plain) and resolve_elastic_plan({"model_path": moe_dir}, plain, cpu) is None
    given, fixed = primary(moe_dir, cpu, max_ep_size=1)  # NOTE: max == tp: nothing to grow into
    assert not is_elastic(fixed) and resolve_elastic_plan(given, fixed, cpu) is None


def test_a_joiner_flag_on_the_primary_is_refused_by_name(moe_dir, cpu):
    given, config = primary(moe_dir, cpu, max_ep_size=2)
    with pytest.raises(ValueError, match="--node-rank 1 describes a joining group"):
        resolve_elastic_plan({**given, "node_rank": 1}, config, cpu)


def test_a_joining_group_that_does_not_resolve_names_the_flag_and_the_reason(moe_dir, cpu, monkeypatch):
    import flotilla.serve.elastic_ep as elastic_ep

    real = elastic_ep.joiner_fields

    def broken(given, current, new, initial):
        fields = real(given, current, new, initial)
        return {**fields, "dp_size": fields["tp_size"] + 1} if new == 3 else fields  # NOTE: dp != tp

    monkeypatch.setattr(elastic_ep, "joiner_fields", broken)
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    with pytest.raises(ValueError) as err:
        resolve_elastic_plan(given, config, cpu)
    message = str(err.value)
    assert "--max-ep-size 3" in message and "from 1 to 3 ranks" in message and "dp_size" in message, message
    assert not isinstance(err.value, ResolutionError)


def test_the_plan_names_the_range_it_covers():
    plan = ElasticEPPlan(initial_size=1, max_ep_size=2, scale_timeout_s=5.0, joiner_configs={})
    with pytest.raises(ValueError, match="from 2 to 3 ranks.*max_ep_size=2"):
        plan.joiner_config(2, 3)


def test_serving_options_refuse_what_an_elastic_deployment_cannot_do(moe_dir, cpu):
    from flotilla.serve.app import build_app, engine_capacity, serve_options

    given, config = primary(moe_dir, cpu, max_ep_size=2, max_running_requests=8)
    plan = resolve_elastic_plan(given, config, cpu)
    options = serve_options(config, model=moe_dir, elastic_plan=plan)
    assert options.num_replicas == 1 and options.elastic_plan is plan
    # Serve's bound leaves room for the grown group (a joined DP rank runs 8 more).
    queued = options.max_queued_requests
    assert engine_capacity(config, options) == 16 + queued
    assert engine_capacity(config, serve_options(config, model=moe_dir)) == 8 + queued
    with pytest.raises(ValueError, match="--num-replicas 2: an elastic EP deployment runs one engine replica"):
        serve_options(config, model=moe_dir, elastic_plan=plan, num_replicas=2)
    with pytest.raises(ValueError, match="--num-replicas 3"):
        build_app(config, ServeOptions(num_replicas=3, elastic_plan=plan))
    with pytest.raises(ValueError, match="--elastic-ep-autoscale needs an elastic EP deployment"):
        serve_options(config, model=moe_dir, elastic_autoscale=ElasticAutoscaleOptions(enabled=True))


def test_autoscale_options_parse_with_off_and_refuse_by_flag():
    options = elastic_autoscale_options(
        {"elastic_ep_autoscale": "true", "elastic_ep_autoscale_kv_usage": "off", "elastic_ep_autoscale_window": "12",
         "elastic_ep_autoscale_step": 2, "elastic_ep_autoscale_interval": None}
    )  # fmt: skip
    assert (options.enabled, options.kv_usage_threshold, options.window_s, options.step) == (True, None, 12.0, 2)
    assert options.interval_s == ElasticAutoscaleOptions().interval_s
    policy = options.policy(4)
    assert (policy.max_ep_size, policy.window_s, policy.kv_usage_threshold) == (4, 12.0, None)
    assert elastic_autoscale_options({}) == ElasticAutoscaleOptions()
    for args, words in (
        ({"elastic_ep_autoscale_window": "5"}, "--elastic-ep-autoscale-window need --elastic-ep-autoscale"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_ttft_p90": "soon"},
         "--elastic-ep-autoscale-ttft-p90 expects a number or off, got 'soon'"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_kv_usage": "1.5"}, "--elastic-ep-autoscale-kv-usage"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_interval": "0"}, "--elastic-ep-autoscale-interval"),
    ):  # fmt: skip
        with pytest.raises(ArgumentError) as err:
            elastic_autoscale_options(args)
        assert words in str(err.value), str(err.value)


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
    metrics = engine.metrics.enable_elastic_ep(lambda: engine.ep_size, engine.dp_rank_requests)
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
    return scaler, create_app(StubElasticClient(scaler), None, options, SimpleNamespace())


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
