"""Server flags ``LLM(...)`` acts on the way ``flotilla serve`` does: the chat template and its
default arguments in ``LLM.chat``, and ``dp_size`` (replicas are the server's; one ``LLM`` is
one engine, so a replica count is refused)."""

import pytest

from flotilla import LLM, SamplingParams
from flotilla.resolution import ArgumentError

CONTENT_ONLY = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if shout %}!{% endif %}"
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm_with_template():
    return LLM(chat_template=CONTENT_ONLY, default_chat_template_kwargs={"shout": True}, max_total_tokens=1024)


def test_chat_renders_with_the_chat_template_flag_and_its_default_kwargs(llm_with_template):
    (out,) = llm_with_template.chat([{"role": "user", "content": "hi"}], ONE_TOKEN)
    assert out.prompt == "[hi]!"
    (own,) = llm_with_template.chat([{"role": "user", "content": "hi"}], ONE_TOKEN, chat_template="<{{ messages[0]['content'] }}>")
    assert own.prompt == "<hi>"  # NOTE: the call's own template wins
    default = LLM(max_total_tokens=1024).chat([{"role": "user", "content": "hi"}], ONE_TOKEN)[0]
    assert "<|im_start|>user" in default.prompt


def test_dp_size_without_dp_attention_is_refused():
    with pytest.raises(ArgumentError, match=r"--dp-size 2 without --enable-dp-attention .* LLM\(\.\.\.\) is one engine"):
        LLM(dp_size=2, max_total_tokens=1024)
