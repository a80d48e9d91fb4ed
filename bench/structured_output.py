"""Structured-output serving benchmark: JSON-schema-constrained chat requests against any
OpenAI-compatible server (argosy serve, vllm serve), at a fixed concurrency.

Every request asks for a person as JSON and constrains the reply to a schema with vLLM's
`structured_outputs` extra (both servers take it). Reports requests/s, output tokens/s,
latency and the fraction of replies that parse and validate against the schema.

    python bench/structured_output.py --base-url http://127.0.0.1:8000 --label argosy \\
        --json docs/benchmarks/structured_output/argosy.json
Results and the commands that produced them: docs/benchmarks/structured_output.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "New York", "Lagos"]},
        "email": {"type": "string", "maxLength": 32},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "is_student"],
    "additionalProperties": False,
}


async def one(client: httpx.AsyncClient, args: argparse.Namespace, i: int) -> dict:
    body = {
        "model": args.model, "temperature": 0, "max_tokens": args.max_tokens,
        "messages": [{"role": "user", "content":
                      f"Invent person number {i} (name, age, city, email, is_student) as JSON."}],
    }
    if args.mode == "compact":
        body["structured_outputs"] = {"json": PERSON, "disable_any_whitespace": True}
    elif args.mode == "flexible":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON}}
    start = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    latency = time.perf_counter() - start
    r.raise_for_status()
    reply = r.json()
    text = reply["choices"][0]["message"]["content"]
    try:
        jsonschema.validate(json.loads(text), PERSON)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        valid = False
    return {"latency": latency, "tokens": reply["usage"]["completion_tokens"], "valid": valid,
            "finish_reason": reply["choices"][0]["finish_reason"], "text": text}


async def run(args: argparse.Namespace) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        await one(client, args, -1)  # warm-up: compiles the grammar, fills caches

        async def limited(i: int) -> dict:
            async with sem:
                return await one(client, args, i)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(args.num_requests)))
        wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "label": args.label, "mode": args.mode, "num_requests": args.num_requests,
        "concurrency": args.concurrency, "wall_s": round(wall, 2),
        "requests_per_s": round(args.num_requests / wall, 2),
        "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(latencies[-1], 3),
        "valid_fraction": sum(r["valid"] for r in results) / len(results),
        "sample": results[0]["text"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--label", default="server")
    p.add_argument("--mode", choices=["compact", "flexible", "none"], default="compact",
                   help="compact: structured_outputs json + disable_any_whitespace; flexible: "
                        "response_format json_schema; none: unconstrained (a baseline)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="append the summary to this JSON-lines file")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
