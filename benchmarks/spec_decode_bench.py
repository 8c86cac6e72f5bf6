"""What speculative decoding buys one request at a time: NGRAM on copy-heavy prompts, against
the same engine without speculation, side by side in one process; and STANDALONE with the
target as its own draft (its acceptance).

    python benchmarks/spec_decode_bench.py [--rounds 3] [--max-tokens 256] [--num-draft-tokens 8]
                                           [--json OUT]

The model is SmolLM2-135M-Instruct (the embedded default, its default dtype). Each prompt
asks to repeat or edit a block of code; every request is greedy and runs alone (concurrency
1), on a fresh engine over the same loaded runner, so the n-gram trie holds only that
request's own prompt and output and no prefix is cached from an earlier run. Each round runs
every prompt without and then with NGRAM, so machine noise hits both alike. Reported per
prompt: output tokens per second (the request's tokens over its wall time, prefill included),
the ratio NGRAM / plain (median over rounds), the acceptance rate and the tokens per step;
the outputs with and without speculation are checked to be equal. STANDALONE runs each
prompt once with ``--speculative-draft-model-path smollm2`` and reports its acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.deploy.bench_env import write_result
from flotilla.resolution.config import ResolvedConfig, thaw

# The block of code every prompt hands the model (a data file: it is text, not this script's code).
CODE = (Path(__file__).resolve().parent / "spec_decode_code.txt").read_text()

PROMPTS = {
    "repeat": "Repeat the following Python code exactly, with no comments:\n\n" + CODE,
    "rename": "Rewrite this code with the class renamed from Inventory to Stock. Change nothing else:\n\n" + CODE,
    "edit": "Rewrite this code so that add() and remove() raise ValueError when count is negative:\n\n" + CODE,
}


def engine_with(llm: LLM, **fields) -> LLMEngine:
    """A fresh engine over ``llm``'s runner (no second load) whose config sets ``fields``."""
    config = ResolvedConfig.build({**thaw(llm.engine.config.config), **fields}, llm.engine.config.env, ())
    return LLMEngine(config, llm.engine.source, llm.tokenizer, runner=llm.engine.runner)


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams) -> dict:
    started = time.perf_counter()
    request_id = engine.add_request(ids, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - started
    output = engine.pop_output(request_id).outputs[0]
    tokens = len(output.token_ids)
    result = {"wall_s": wall, "tokens": tokens, "output_tok_s": tokens / wall, "steps": steps, "token_ids": output.token_ids}
    if engine.speculator is not None:
        stats = engine.speculator.stats
        result.update(
            draft_tokens=stats.num_draft_tokens,
            accepted_tokens=stats.num_accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            tokens_per_step=tokens / steps,
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens (drafts per step + 1)")
    parser.add_argument("--standalone-steps", type=int, default=3, help="STANDALONE's --speculative-num-steps")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    llm = LLM(max_total_tokens=8192)
    tokenizer = llm.tokenizer
    ids = {
        name: tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for name, text in PROMPTS.items()
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": args.num_draft_tokens}
    run_one(engine_with(llm), ids["repeat"][:64], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    rounds = []
    for _ in range(args.rounds):
        for name, prompt in ids.items():
            plain = run_one(engine_with(llm), prompt, params)
            spec = run_one(engine_with(llm, **ngram), prompt, params)
            rounds.append({
                "prompt": name, "prompt_tokens": len(prompt), "plain_output_tok_s": plain["output_tok_s"],
                "ngram_output_tok_s": spec["output_tok_s"], "ratio": spec["output_tok_s"] / plain["output_tok_s"],
                "tokens": spec["tokens"], "same_tokens": spec["token_ids"] == plain["token_ids"],
                "acceptance_rate": spec["acceptance_rate"], "tokens_per_step": spec["tokens_per_step"],
            })  # fmt: skip
            print(json.dumps(rounds[-1]))
    per_prompt = {}
    for name in ids:
        mine = [r for r in rounds if r["prompt"] == name]
        per_prompt[name] = {
            "prompt_tokens": mine[0]["prompt_tokens"],
            "output_tokens": mine[0]["tokens"],
            "plain_output_tok_s": statistics.median(r["plain_output_tok_s"] for r in mine),
            "ngram_output_tok_s": statistics.median(r["ngram_output_tok_s"] for r in mine),
            "ratio_median": statistics.median(r["ratio"] for r in mine),
            "acceptance_rate": statistics.median(r["acceptance_rate"] for r in mine),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in mine),
            "same_tokens": all(r["same_tokens"] for r in mine),
        }
    standalone = {}
    draft = engine_with(
        llm, speculative_algorithm="STANDALONE", speculative_num_steps=args.standalone_steps,
        speculative_draft_model_path="smollm2",
    )  # fmt: skip
    for name, prompt in ids.items():
        before = (draft.speculator.stats.num_draft_tokens, draft.speculator.stats.num_accepted_tokens)
        out = run_one(draft, prompt, params)
        drafted, accepted = out["draft_tokens"] - before[0], out["accepted_tokens"] - before[1]
        standalone[name] = {
            "output_tok_s": out["output_tok_s"],
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_step": out["tokens_per_step"],
        }
    result = {
        "args": vars(args),
        "model": "SmolLM2-135M-Instruct (embedded)",
        "dtype": str(llm.engine.config.dtype),
        "ngram": per_prompt,
        "standalone_self_draft": standalone,
        "rounds": rounds,
    }
    print(json.dumps({"ngram": per_prompt, "standalone_self_draft": standalone}, indent=2))
    if args.json:
        write_result(args.json, result)
    llm.shutdown()


if __name__ == "__main__":
    main()
