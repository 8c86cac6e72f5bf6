"""``flotilla serve --model <tiny GLM-5> --tp 2 --ep 2``, live: the command starts its own local
Ray cluster on loopback (not the test session's) and deploys a two-rank engine (MLA heads and
experts split, DSA with IndexShare on the torch reference, as the ``cpu`` platform resolves it);
the official openai client's completions equal the single in-process engine's greedy tokens.

The tiny model ships a word tokenizer (token ``i`` is the word ``w<i>``), so a completion's text
reads back as its token ids; exact equality needs no tolerance (see test_dsa_parallel.py: the same
prompts, whose top-k boundaries test_dsa.py checks).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from flotilla import LLM, SamplingParams
from helpers.prompts import random_prompts
from helpers.tiny_dsa import ENGINE_PROMPT_LENS, save_tiny_dsa
from helpers.tiny_models import save_word_tokenizer, word_token_ids

REPO_ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 300
NEW_TOKENS = 32
FLAGS = ("--chunked-prefill-size", "16", "--max-total-tokens", "192")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm5-serve")
    save_tiny_dsa(path, "glm5")
    save_word_tokenizer(path, 128)
    prompts = random_prompts(ENGINE_PROMPT_LENS, 128, seed=2)
    llm = LLM(str(path), chunked_prefill_size=16, max_total_tokens=192)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return path, prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]


@pytest.fixture(scope="module")
def server(glm5):
    path = glm5[0]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # NOTE: its own cluster
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--model", str(path), "--port", str(port),
         "--tp", "2", "--ep", "2", *FLAGS],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    _wait_for_ready(process)
    try:
        yield port
    finally:
        _stop(process)


def _wait_for_ready(process: subprocess.Popen) -> None:
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line.rstrip())
        if line.startswith("flotilla serve:") and " is ready at http://" in line:
            return
    _stop(process)
    raise AssertionError("flotilla serve did not get ready:\n" + "\n".join(lines[-40:]))


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_the_openai_client_gets_the_single_engines_greedy_tokens(glm5, server):
    path, prompts, expected = glm5
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt, want in zip(prompts, expected):
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert word_token_ids(reply.choices[0].text) == want
        assert reply.usage.completion_tokens == NEW_TOKENS
