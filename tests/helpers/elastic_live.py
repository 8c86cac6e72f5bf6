"""Live elastic EP deployments for the serve tests: a tiny random Qwen3-MoE (8 experts; a
word-level tokenizer whose text reads back as token ids) in the issue's layout (``--tp 1 --dp 1
--ep 1 --enable-dp-attention --enable-dp-lm-head --elastic-ep-backend ray --max-ep-size N
--disable-cuda-graph``), deployed through the real Serve application on the session's Serve and
driven over HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx

from helpers.prompts import random_prompts
from helpers.tiny_models import save_word_tokenizer, word_token_ids
from helpers.tiny_moe import save_tiny_qwen3_moe

VOCAB = 256
ELASTIC = dict(
    tp_size=1, dp_size=1, ep_size=1, enable_dp_attention=True, enable_dp_lm_head=True,
    elastic_ep_backend="ray", max_ep_size=2, disable_cuda_graph=True,
)  # fmt: skip


def deploy_elastic(serve_http: str, path: Path, app: str, prefix: str, flags: dict | None = None, **options):
    """Deploy an elastic EP application named ``app`` at ``prefix`` (model saved in ``path``;
    ``flags``: server fields over :data:`ELASTIC`; ``options``: more ``serve_options``) and wait
    until it is healthy. Returns ``SimpleNamespace(url, name, prompts, plan)``; the caller
    deletes the application."""
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_application
    from flotilla.serve.plan import plan_serving

    save_tiny_qwen3_moe(path)
    save_word_tokenizer(path, VOCAB)
    given = {"model_path": str(path), **ELASTIC, "max_total_tokens": 4096, "disable_radix_cache": True, **(flags or {})}
    planned = plan_serving(given, platform=probe(), **options)
    opts, plan = planned.options, planned.options.elastic_plan
    serve.run(build_application(planned), name=app, route_prefix=prefix)
    url = f"{serve_http}{prefix}"
    wait_until_healthy(url, 120)
    prompts = random_prompts((5, 9, 13, 17, 21, 25), VOCAB, seed=11)
    return SimpleNamespace(url=url, name=opts.served_model_name, prompts=prompts, plan=plan, reference={})


def completion_body(deployment, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {
        "model": deployment.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def stream_tokens(deployment, prompt: list[int], max_tokens: int, on_first=None) -> list[int]:
    """A streaming greedy completion's token ids; AssertionError on any error."""
    text, first = "", True
    body = completion_body(deployment, prompt, max_tokens, True)
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if first and on_first is not None:
                on_first()
            first = False
    return word_token_ids(text)


def scale(deployment, body) -> httpx.Response:
    return httpx.post(f"{deployment.url}/scale_elastic_ep", json=body, timeout=300)


def is_scaling(deployment, method: str = "GET") -> bool:
    response = httpx.request(method, f"{deployment.url}/is_scaling_elastic_ep", timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"is_scaling_elastic_ep"} and isinstance(body["is_scaling_elastic_ep"], bool)
    return body["is_scaling_elastic_ep"]


def model_card(deployment) -> dict:
    return httpx.get(f"{deployment.url}/v1/models", timeout=10).json()["data"][0]
