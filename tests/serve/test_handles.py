"""Handle calls from inside a replica, live on the session's Serve: two concurrent calls made
while serving one request both reach a deployment routed by flotilla's router.

NOTE: Serve (2.60) gives every handle call made inside a replica the internal id of the
request being served, and its request router matches a chosen replica to a pending call by
that id; without :func:`flotilla.serve.handles.call` one of the two calls below is never
matched and waits forever (the first request of a two-prompt ``/v1/completions`` hung so).
"""

import asyncio

import pytest

APP = "flotilla-handles-test"


@pytest.fixture(scope="module")
def front(serve_http):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from flotilla.serve.handles import call

    @serve.deployment(
        request_router_config=RequestRouterConfig(request_router_class="flotilla.serve.router.PrefixAffinityRouter")
    )
    class Echo:
        async def twice(self, x: int) -> int:
            await asyncio.sleep(0.05)
            return 2 * x

    @serve.deployment
    class Front:
        def __init__(self, echo):
            self.echo = echo

        async def both(self, a: int, b: int) -> list[int]:
            calls = [call(self.echo.twice, a), call(self.echo.twice, b)]
            return list(await asyncio.wait_for(asyncio.gather(*calls), 20))

    handle = serve.run(Front.bind(Echo.bind()), name=APP, route_prefix=None)
    yield handle
    serve.delete(APP)


def test_concurrent_calls_of_one_request_all_reach_the_deployment(front):
    # NOTE: the very first calls through a fresh router, then a few more rounds.
    for a in range(4):
        assert front.both.remote(a, a + 10).result(timeout_s=60) == [2 * a, 2 * (a + 10)]
