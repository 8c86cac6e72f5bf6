"""The HF transformers side of ``flotilla bench offline --compare-hf``.

The same weights (the same HF directory or GGUF file), the same dtype and the same
prompts, in this process: ``generate`` greedy with exactly ``output_len`` new tokens
(end-of-sequence switched off: ``ignore_eos``), once prompt by prompt (batch 1)
and once as one left-padded batch.
"""

from __future__ import annotations

import time
from typing import Any


def load_hf_model(llm) -> Any:
    """The HF model of ``llm``'s source, in the dtype flotilla runs."""
    import torch
    from transformers import AutoModelForCausalLM

    source = llm.source
    dtype = next(llm.engine.runner.model.parameters()).dtype
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=dtype, local_files_only=True
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype, local_files_only=True)
    return model.to(torch.device(llm.config.device or "cpu")).eval()


def compare_with_hf(llm, prompts: list[list[int]], output_len: int, sequential_prompts: int | None) -> dict[str, Any]:
    """HF batch-1 sequential and padded-batch results, and flotilla's ratios to them."""
    import torch

    started = time.perf_counter()
    model = load_hf_model(llm)
    load_s = time.perf_counter() - started
    pad_id = llm.source.config_dict.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) else 0
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None  # NOTE: ignore_eos, as flotilla's run
    kwargs = dict(max_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)

    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]], device=device), **{**kwargs, "max_new_tokens": 4})
        subset = prompts[: sequential_prompts or len(prompts)]
        started = time.perf_counter()
        produced = 0
        for prompt in subset:
            out = model.generate(torch.tensor([prompt], device=device), **kwargs)
            produced += out.shape[1] - len(prompt)
        sequential = _row(time.perf_counter() - started, subset, produced, concurrent=1)

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):  # NOTE: left padding, as decoder-only generate needs
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        started = time.perf_counter()
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        batched = _row(time.perf_counter() - started, prompts, (out.shape[1] - width) * len(prompts), len(prompts))
    return {"hf_load_s": load_s, "hf_sequential": sequential, "hf_batched": batched}


def _row(wall: float, prompts: list[list[int]], produced: int, concurrent: int) -> dict[str, Any]:
    """Throughput over the wall time; ``ms_per_output_token`` is per request (``concurrent``
    requests share the wall), prefill included, since HF does not report token times."""
    in_tokens = sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "requests": len(prompts),
        "input_tokens": in_tokens,
        "output_tokens": produced,
        "input_tok_s": in_tokens / wall,
        "output_tok_s": produced / wall,
        "ms_per_output_token": 1000 * wall * concurrent / produced,
    }
