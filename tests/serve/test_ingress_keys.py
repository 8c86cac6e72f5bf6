"""Who may call what (``--api-key``, ``--admin-api-key``) and the ``priority`` body field, on
the ingress app over httpx's ASGI transport, with a stub engine that answers the admin calls
of an elastic EP deployment (the admin routes 404 on any other)."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from flotilla.serve.types import ElasticEPPlan
from flotilla.serve.ingress import ADMIN_ROUTES, create_app
from flotilla.serve.types import CompletionChunk, GenerateChunk, ServeOptions

USER, ADMIN = "user-key", "admin-key"


class ElasticStub:
    """Answers generation with one token (recording each request) and the elastic EP admin calls."""

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield GenerateChunk(request.request_id, [CompletionChunk(0, [7], "x", finish_reason="length")], True, 3, 1)

    async def is_healthy(self):
        return True

    async def metrics_text(self):
        return ""

    async def scale_elastic_ep(self, new_ep_size):
        return {"message": f"scaled to {new_ep_size}", "ep_size": new_ep_size}

    async def is_scaling_elastic_ep(self):
        return False

    async def elastic_ep_state(self):
        return {"ep_size": 1, "max_ep_size": 2}


def app_with(api_key=None, admin_api_key=None, **config):
    engine = ElasticStub()
    plan = ElasticEPPlan(initial_size=1, max_ep_size=2, scale_timeout_s=5.0)
    options = ServeOptions(served_model_name="m", api_key=api_key, elastic_plan=plan)
    config = SimpleNamespace(api_key=api_key, admin_api_key=admin_api_key, context_length=64, page_size=16, **config)
    return create_app(engine, None, options, config), engine


def call(app, method, path, key=None, json=None):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://flotilla.test") as http:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return await http.request(method, path, headers=headers, json=json)

    return asyncio.run(main())


SCALE = ("POST", "/scale_elastic_ep", {"new_ep_size": 2})
POLL = ("GET", "/is_scaling_elastic_ep", None)
POLL_POST = ("POST", "/is_scaling_elastic_ep", None)
COMPLETE = ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})


@pytest.mark.parametrize("route", [SCALE, POLL, POLL_POST], ids=["scale", "poll", "poll-post"])
def test_admin_routes_need_the_admin_key_and_not_the_user_key(route):
    app, _ = app_with(api_key=USER, admin_api_key=ADMIN)
    method, path, body = route
    for key in (None, USER, "wrong"):
        response = call(app, method, path, key, body)
        assert response.status_code == 401, (key, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and "--admin-api-key" in error["message"]
    answer = call(app, method, path, ADMIN, body)
    assert answer.status_code == 200, answer.text
    assert answer.json() in ({"message": "scaled to 2", "ep_size": 2}, {"is_scaling_elastic_ep": False})


def test_the_admin_key_alone_guards_only_the_admin_routes():
    app, _ = app_with(admin_api_key=ADMIN)
    assert call(app, *SCALE[:2], None, SCALE[2]).status_code == 401
    assert call(app, *SCALE[:2], ADMIN, SCALE[2]).status_code == 200
    assert call(app, *COMPLETE[:2], None, COMPLETE[2]).status_code == 200  # NOTE: no --api-key: open
    # NOTE: the admin key opens no user route when a user key is set.
    guarded, _ = app_with(api_key=USER, admin_api_key=ADMIN)
    assert call(guarded, *COMPLETE[:2], ADMIN, COMPLETE[2]).status_code == 401
    assert call(guarded, *COMPLETE[:2], USER, COMPLETE[2]).status_code == 200


def test_without_an_admin_key_the_user_key_guards_the_admin_routes():
    app, _ = app_with(api_key=USER)
    assert call(app, *SCALE[:2], None, SCALE[2]).status_code == 401
    assert call(app, *SCALE[:2], USER, SCALE[2]).status_code == 200
    assert set(ADMIN_ROUTES) == {"/scale_elastic_ep", "/is_scaling_elastic_ep"}
    open_app, _ = app_with()
    assert call(open_app, *SCALE[:2], None, SCALE[2]).status_code == 200
    assert call(open_app, "GET", "/health").status_code == 200


def test_priority_reaches_the_engine_and_bad_values_are_a_400():
    app, engine = app_with()
    assert call(app, "POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "priority": -7}).status_code == 200
    assert engine.requests[-1].priority == -7
    assert call(app, "POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200
    assert engine.requests[-1].priority is None  # NOTE: the engine applies --default-priority-value
    for bad in (1 << 40, 1.5, "high"):
        response = call(app, "POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "priority": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "priority"
