"""What ``--host`` and ``--port`` change: where ``flotilla serve`` has Serve's HTTP proxy bind,
and the URL it waits on and prints.

``flotilla serve``'s ``deploy`` runs for real from the parsed command line, except that Serve
itself is a stand-in: ``serve.start`` binds a small HTTP server exactly where the
``http_options`` it is handed say (answering ``/health`` as the proxy would) and ``serve.run``
records the application. No Ray is started. The runtime-support table names these tests as
evidence (``tests/helpers/support_evidence.py``).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flotilla.deploy.serve_cmd import deploy, parse_serve_args, plan_for, ready_message
from flotilla.resolution.platform import PRESETS
from helpers.tiny_models import save_tiny_llama


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy(monkeypatch):
    """Serve's stand-in: ``started`` gets each ``serve.start`` call's ``http_options`` and the
    server bound for it, ``apps`` each ``serve.run`` call's application name."""
    from ray import serve

    started, apps, servers = [], [], []

    def start(http_options=None, **kwargs):
        server = ThreadingHTTPServer((http_options["host"], http_options["port"]), _Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        started.append(dict(http_options))

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "run", lambda app, name=None, **kwargs: apps.append(name))
    yield started, apps
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-deploy")
    save_tiny_llama(path)
    return str(path)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def deployed(model_dir: str, *flags: str):
    opts, given = parse_serve_args(["--model-path", model_dir, *flags])
    plan = plan_for(opts, given, PRESETS["cpu"])
    return plan.config, plan.options, deploy(plan)


def _answers(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_host_and_port_are_where_the_proxy_binds_and_what_the_url_names(proxy, model_dir):
    """``--host 127.0.0.2`` (a loopback address other than the default 127.0.0.1) and a free
    port: the proxy binds there, ``deploy`` waits for ``/health`` there and the ready message
    names it; nothing listens on the default address at that port."""
    started, apps = proxy
    port = free_port("127.0.0.2")
    config, options, url = deployed(model_dir, "--host", "127.0.0.2", "--port", str(port))
    assert started == [{"host": "127.0.0.2", "port": port}] and apps == ["flotilla"]
    assert url == f"http://127.0.0.2:{port}"
    assert _answers("127.0.0.2", port) and not _answers("127.0.0.1", port)
    assert f"{url}/v1/chat/completions" in ready_message(url, options, config)


def test_port_alone_moves_the_port_on_the_default_loopback_host(proxy, model_dir):
    started, _ = proxy
    port = free_port("127.0.0.1")
    _, _, url = deployed(model_dir, "--port", str(port))
    assert started == [{"host": "127.0.0.1", "port": port}] and url == f"http://127.0.0.1:{port}"
    assert _answers("127.0.0.1", port)
