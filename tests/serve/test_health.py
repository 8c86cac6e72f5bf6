"""``/health``: a plain engine client answers 200 or 503; one that reports its pools (the PD
client) has its report as the body, 200 while the endpoint serves (ok, or degraded: the
decode pool serves every request whole) and 503 when it cannot."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from flotilla.serve.ingress import create_app
from flotilla.serve.types import ServeOptions


class Plain:
    def __init__(self, healthy):
        self.healthy = healthy

    async def is_healthy(self):
        return self.healthy

    async def metrics_text(self):
        return ""


class Pools(Plain):
    def __init__(self, status):
        super().__init__(status != "down")
        self.status = status

    async def health(self):
        pools = {"prefill": {"healthy": self.status == "ok"}, "decode": {"healthy": self.status != "down"}}
        return {"status": self.status, "pools": pools}


def get(engine, method="GET"):
    app = create_app(engine, None, ServeOptions(served_model_name="m"), SimpleNamespace(page_size=None))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.request(method, "/health")

    return asyncio.run(main())


@pytest.mark.parametrize("healthy, status", [(True, 200), (False, 503)])
def test_a_plain_engine_is_healthy_or_not(healthy, status):
    assert get(Plain(healthy)).status_code == status
    assert get(Plain(healthy), "HEAD").status_code == status


@pytest.mark.parametrize("state, status", [("ok", 200), ("degraded", 200), ("down", 503)])
def test_a_pool_report_is_the_body(state, status):
    response = get(Pools(state))
    assert response.status_code == status
    assert response.json()["status"] == state and set(response.json()["pools"]) == {"prefill", "decode"}
