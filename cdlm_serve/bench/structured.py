"""Structured outputs' cost: decode tokens/s with and without a JSON schema, side by side.

The AR engine on SmolLM2-135M-Instruct (bf16 by default), 1 and 8 concurrent answers of
`--new-tokens` tokens each, sampled (temperature 1, seeded), runs interleaved (without,
with, without, ...) so machine noise hits both; medians are reported. The schema asks for an
array of at least 1,000 objects ({"name": string, "qty": integer, "tags": [string]}), so every
answer runs its whole budget either way: the comparison is per token, the grammar's mask and
advance against nothing. Also reports what the first use of a schema costs: building the
model's tokenizer for the grammar engine (once per model) and compiling the schema (once per
schema: then it is cached).

With `--http`, the same through a real server and clients instead: `cdlm-serve` started on the
model, and 1 and 8 clients each sending one chat completion at a time, with `response_format` a
JSON schema or without, the answers' tokens/s over the wall time (the prefill, the HTTP and the
streaming included: what a user sees).

    python -m cdlm_serve.bench.structured [--new-tokens 96] [--runs 3] [--http] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from cdlm_serve.bench.decode import decode_args, prompt_ids
from cdlm_serve.bench.load import free_port, start, stop
from cdlm_serve.engine.decoding import AREngine, GenerationOptions, GrammarSpec
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import resolve

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "qty": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "qty", "tags"],
        "additionalProperties": False,
    },
}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))


def tok_s(engine: AREngine, ids: list[int], clients: int, new: int, grammar: bool) -> float:
    """Tokens/s of `clients` answers decoded together (all of `new` tokens)."""
    spec = GRAMMAR if grammar else None
    for i in range(clients):
        options = GenerationOptions(temperature=1.0, ignore_eos=True, grammar=spec)
        engine.add(engine.new_sequence(f"c{i}", ids, engine.params(options, new, 1000 + i)))
    n, t = 0, time.perf_counter()
    while engine.has_work():
        n += sum(len(o.token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t
    assert n == clients * new, (n, clients * new)  # every answer ran its budget
    return n / elapsed


async def _clients_tok_s(url: str, model: str, clients: int, new: int, grammar: bool) -> float:
    """Tokens/s of `clients` concurrent chat completions over HTTP (all of `new` tokens)."""
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": "List the items of an inventory as JSON."}],
        "max_tokens": new,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    if grammar:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "inventory", "schema": SCHEMA},
        }

    async def one(client: httpx.AsyncClient, seed: int) -> int:
        r = await client.post(f"{url}/v1/chat/completions", json={**body, "seed": seed})
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        done = await asyncio.gather(*(one(client, 1000 + i) for i in range(clients)))
        elapsed = time.perf_counter() - t
    assert sum(done) == clients * new, (done, new)  # every answer ran its budget
    return sum(done) / elapsed


def _rows(measure, runs: int, new: int) -> list[dict]:
    """Each client count's interleaved runs, without and with the schema (medians)."""
    rows = []
    for clients in (1, 8):
        measure(clients, 8, False)  # warm-up
        measure(clients, 8, True)
        plain, ruled = [], []
        for _ in range(runs):
            plain.append(measure(clients, new, False))
            ruled.append(measure(clients, new, True))
        p, r = statistics.median(plain), statistics.median(ruled)
        rows.append({
            "clients": clients,
            "without_tok_s": round(p, 1),
            "with_schema_tok_s": round(r, 1),
            "ratio": round(r / p, 3),
            "without_runs": [round(x, 1) for x in plain],
            "with_runs": [round(x, 1) for x in ruled],
        })  # fmt: skip
    return rows


def _over_http(args: argparse.Namespace) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as scratch:
        cmd = [sys.executable, "-m", "cdlm_serve.server.cli", "serve", "--model", args.model,
               "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--sessions-dir", scratch, "--log-level", "warning"]  # fmt: skip
        proc = start(cmd, url, Path(scratch) / "server.log")
        try:
            name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

            def measure(clients: int, new: int, grammar: bool) -> float:
                return asyncio.run(_clients_tok_s(url, name, clients, new, grammar))

            return _rows(measure, args.runs, args.new_tokens)
        finally:
            stop(proc)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(parser, new_tokens=96)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--http", action="store_true", help="through a server and clients")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    fused = kernels.enable_cpu_kernels()
    tok = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=getattr(torch, args.dtype))
    engine = AREngine(model, tok, max_model_len=model.config.max_position_embeddings)
    ids = prompt_ids(tok, args.prompt_tokens)

    t = time.perf_counter()
    engine.grammars.matcher(GrammarSpec("json_object"))  # builds the tokenizer, compiles one
    first_use = time.perf_counter() - t
    before = engine.grammars.compile_seconds
    engine.grammars.matcher(GRAMMAR)
    compile_s = engine.grammars.compile_seconds - before
    t = time.perf_counter()
    engine.grammars.matcher(GRAMMAR)
    cached_s = time.perf_counter() - t

    if args.http:
        del engine, model  # the server holds its own
        rows = _over_http(args)
    else:
        rows = _rows(
            lambda clients, new, grammar: tok_s(engine, ids, clients, new, grammar),
            args.runs,
            args.new_tokens,
        )
    result = {
        "model": args.model,
        "over": "http" if args.http else "engine",
        "dtype": args.dtype,
        "cpu_kernels": kernels.active_isa() if fused else "off",
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "first_use_seconds": round(first_use, 3),
        "schema_compile_seconds": round(compile_s, 4),
        "cached_schema_seconds": round(cached_s, 5),
        "rows": rows,
    }
    print(
        f"\nstructured outputs ({result['over']}), {args.model}, {args.dtype}, sampled, "
        f"{args.new_tokens} new "
        f"tokens per answer, {args.runs} interleaved runs (median), "
        f"{torch.get_num_threads()} threads, fused kernels: {result['cpu_kernels']}"
    )
    print(f"{'clients':>8}{'without':>10}{'schema':>10}{'ratio':>8}   tok/s")
    for row in rows:
        print(
            f"{row['clients']:>8}{row['without_tok_s']:>10.1f}{row['with_schema_tok_s']:>10.1f}"
            f"{row['ratio']:>8.2f}"
        )
    print(
        f"first use of a grammar on this model (its tokenizer for llguidance): {first_use:.2f} s; "
        f"compiling the schema: {compile_s * 1e3:.1f} ms; a cached one: {cached_s * 1e6:.0f} us"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
