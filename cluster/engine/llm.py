"""``LLM``: offline generation, shaped like vLLM's ``LLM``: in this process (no Ray) at
one rank, on a Ray worker group (started locally when none is running) when tp_size > 1.

    from flotilla import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])

The server configuration is resolved ONCE, in the constructor, from the same
flags ``flotilla serve`` takes (as keyword arguments: ``LLM(model, max_total_tokens=4096,
chunked_prefill_size=512)``), the model's config.json and the probed platform facts
of the workers' hardware (a Ray task on a worker node when connected to a cluster, else
this machine); ``llm.config`` holds the frozen result.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from flotilla.cluster.engine.configure import check_user_settings, resolve_engine_config
from flotilla.cluster.engine.gc_pauses import frozen_heap
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.outputs import RequestOutput
from flotilla.cluster.engine.sampling_params import SamplingParams, as_param_list
from flotilla.cluster.log_level import apply_log_level
from flotilla.cluster.models.tokenizer import load_chat_template
from flotilla.resolution import ArgumentError, PlatformFacts


Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """An in-process engine over one model.

    Args:
        model: ``None`` or ``"smollm2"`` (the embedded default), a local HF model directory,
            or a ``.gguf`` file. Nothing is downloaded.
        platform: platform facts to resolve for (default: probe a worker node of the connected
            Ray cluster as a Ray task, or this machine when none is connected).
        **server_flags: any server field by its ``ServerArgs`` name (``dtype``,
            ``max_total_tokens``, ``chunked_prefill_size``, ``context_length``,
            ``max_running_requests``, ``page_size``, ``disable_radix_cache``, ``random_seed``,
            ``tokenizer_path``, ``skip_tokenizer_init``, ...).
    """

    def __init__(self, model: str | None = None, *, platform: PlatformFacts | None = None, **server_flags: Any):
        given = {**server_flags, "model_path": server_flags.get("model_path", model)}
        # NOTE: before any weight loads: a flag the runtime would not act on is an error.
        check_user_settings(given)
        self.config, self.source = resolve_engine_config(given, platform)
        if int(self.config.dp_size or 1) > 1 and not self.config.enable_dp_attention:
            raise ArgumentError(
                f"--dp-size {self.config.dp_size} without --enable-dp-attention means that many engine replicas, "
                "which flotilla serve runs; LLM(...) is one engine: drop dp_size, or pass enable_dp_attention=True "
                "for DP-attention ranks inside it"
            )
        apply_log_level(self.config)
        self._tokenizer_error: str | None = None
        self.tokenizer = None
        if not self.config.skip_tokenizer_init:
            from flotilla.cluster.models.tokenizer import load_tokenizer_or_none

            self.tokenizer, self._tokenizer_error = load_tokenizer_or_none(self.source, self.config.tokenizer_path)
        self.engine = LLMEngine(self.config, self.source, self.tokenizer)

    def shutdown(self) -> None:
        """Release the engine's workers (a tensor-parallel group's Ray actors); idempotent.
        An in-process engine has nothing to release."""
        stop = getattr(self.engine.runner, "shutdown", None)
        if stop is not None:
            stop()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- generation ----------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one :class:`RequestOutput` per prompt, in order.

        ``prompts``: a string, a list of strings, a list of token-id lists, or
        ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` dicts (vLLM's forms).
        ``priority``: one scheduling priority per prompt (vLLM's argument; needs
        ``enable_priority_scheduling=True``, see ``LLMEngine.priority_of``).
        """
        items = _prompt_list(prompts)
        params = as_param_list(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority: give one per prompt ({len(items)} prompts, {len(priority)} priorities)")
        encoded = [self._encode(p) for p in items]
        return self._run(encoded, params, priority)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}`` messages) or to
        several (a list of such lists), through the chat template: ``chat_template`` when
        given, else the server flag ``chat_template``, else the tokenizer's; with the
        ``default_chat_template_kwargs`` flag's arguments."""
        tokenizer = self._require_tokenizer("messages")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations or any(not c for c in conversations):
            raise ValueError("messages: give at least one message per conversation")
        template = chat_template if chat_template is not None else load_chat_template(self.config.chat_template)
        kwargs = dict(self.config.default_chat_template_kwargs or {})
        texts = [
            tokenizer.apply_chat_template(
                list(c), tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template, **kwargs
            )
            for c in conversations
        ]
        # NOTE: the template already holds the special tokens; encode without adding more.
        encoded = [(text, tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        return self._run(encoded, as_param_list(sampling_params, len(encoded)))

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        added: list[str] = []
        levels = list(priority) if priority is not None else [None] * len(encoded)
        try:
            for (text, token_ids), p, level in zip(encoded, params, levels):
                added.append(self.engine.add_request(token_ids, p, prompt=text, priority=level))
        except Exception:
            for request_id in added:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort(request_id)
                self.engine.step()
                self.engine.pop_output(request_id)
            raise
        pending = set(added)
        with frozen_heap():
            while pending:
                for delta in self.engine.step():
                    if delta.finish_reason is not None and self.engine.get_output(delta.request_id).finished:
                        pending.discard(delta.request_id)
        outputs = [self.engine.pop_output(request_id) for request_id in added]
        if self.engine.dead is not None:
            raise self.engine.dead
        return outputs

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompts: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            return prompt, list(self._require_tokenizer("prompts").encode(prompt))
        return None, [int(t) for t in prompt]

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            reason = self._tokenizer_error or "skip_tokenizer_init is set"
            raise ValueError(f"{what}: text needs a tokenizer, and this LLM has none ({reason}); pass token ids")
        return self.tokenizer


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: give at least one prompt")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as a flat token-id list
    return prompts
