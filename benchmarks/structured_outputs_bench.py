"""What constrained decoding costs a batch: 16 free requests against 16 requests of which
half are constrained by a JSON schema, side by side in one process.

    python benchmarks/structured_outputs_bench.py [--batch 16] [--free-tokens 48] [--rounds 3]
                                                  [--backend xgrammar] [--json OUT]

Both batches run on one engine (SmolLM2-135M-Instruct, the embedded model), alternating
round by round so that machine noise hits both alike. Every request is greedy; the free
requests ignore EOS and generate exactly ``--free-tokens``; the constrained ones stop when
their JSON is whole. Reported per batch: generated tokens per second (all requests'
tokens over the batch's wall time) and the median step time; and the ratio mixed / free.
The free requests' tokens in the mixed batch are checked to equal the all-free batch's
(the mask touches only its own rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.sampling_params import GuidedDecoding
from flotilla.deploy.bench_env import write_result

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 90},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


def run_batch(llm: LLM, conversations, params) -> dict:
    engine, tokenizer = llm.engine, llm.tokenizer
    ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False) for c in conversations]
    start = time.perf_counter()
    added = [engine.add_request(i, p) for i, p in zip(ids, params)]
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    outputs = [engine.pop_output(r).outputs[0] for r in added]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "median_step_ms": 1e3 * statistics.median(steps), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--free-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    llm = LLM(max_total_tokens=16384, grammar_backend=args.backend, max_running_requests=args.batch)
    questions = [[{"role": "user", "content": f"Tell me about person number {i}, as JSON."}] for i in range(args.batch)]
    free = SamplingParams(temperature=0, max_tokens=args.free_tokens, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=args.free_tokens * 2, guided=GuidedDecoding("json_schema", json.dumps(PERSON)))
    mixed_params = [guided if i % 2 else free for i in range(args.batch)]
    run_batch(llm, questions[:2], [free, guided])  # warm-up (and the grammar's compile)
    rounds = []
    for _ in range(args.rounds):
        all_free = run_batch(llm, questions, [free] * args.batch)
        mixed = run_batch(llm, questions, mixed_params)
        same = [a.token_ids for a in all_free["outputs"][0::2]] == [m.token_ids for m in mixed["outputs"][0::2]]
        valid = all(json.loads(m.text) is not None for m in mixed["outputs"][1::2])
        rounds.append({
            "free_tokens_per_s": all_free["tokens_per_s"], "mixed_tokens_per_s": mixed["tokens_per_s"],
            "free_median_step_ms": all_free["median_step_ms"], "mixed_median_step_ms": mixed["median_step_ms"],
            "free_tokens": all_free["tokens"], "mixed_tokens": mixed["tokens"],
            "free_requests_unchanged": same, "constrained_outputs_parse": valid,
        })  # fmt: skip
    summary = {
        "free_tokens_per_s": statistics.median(r["free_tokens_per_s"] for r in rounds),
        "mixed_tokens_per_s": statistics.median(r["mixed_tokens_per_s"] for r in rounds),
        "free_median_step_ms": statistics.median(r["free_median_step_ms"] for r in rounds),
        "mixed_median_step_ms": statistics.median(r["mixed_median_step_ms"] for r in rounds),
    }
    summary["throughput_ratio_mixed_over_free"] = summary["mixed_tokens_per_s"] / summary["free_tokens_per_s"]
    summary["step_time_ratio_mixed_over_free"] = summary["mixed_median_step_ms"] / summary["free_median_step_ms"]
    result = {"args": vars(args), "summary": summary, "rounds": rounds}
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)
    llm.shutdown()


if __name__ == "__main__":
    main()
