"""Structured outputs' cost: decode tokens/s with and without a JSON schema, side by side.

The AR engine on SmolLM2-135M-Instruct (bf16 by default), 1 and 8 concurrent answers of
`--new-tokens` tokens each, sampled (temperature 1, seeded), runs interleaved (without,
with, without, ...) so machine noise hits both; medians are reported. The schema asks for an
array of at least 1,000 objects ({"name": string, "qty": integer, "tags": [string]}), so every
answer runs its whole budget either way: the comparison is per token, the grammar's mask and
advance against nothing. Also reports what the first use of a schema costs: building the
model's tokenizer for the grammar engine (once per model) and compiling the schema (once per
schema: then it is cached).

    python -m cdlm_serve.bench.structured [--new-tokens 96] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cdlm_serve.bench.decode import decode_args, prompt_ids
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(parser, new_tokens=96)
    parser.add_argument("--json", type=Path)
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

    rows = []
    for clients in (1, 8):
        tok_s(engine, ids, clients, 8, False)  # warm-up
        tok_s(engine, ids, clients, 8, True)
        plain, ruled = [], []
        for _ in range(args.runs):
            plain.append(tok_s(engine, ids, clients, args.new_tokens, False))
            ruled.append(tok_s(engine, ids, clients, args.new_tokens, True))
        p, r = statistics.median(plain), statistics.median(ruled)
        rows.append({
            "clients": clients,
            "without_tok_s": round(p, 1),
            "with_schema_tok_s": round(r, 1),
            "ratio": round(r / p, 3),
            "without_runs": [round(x, 1) for x in plain],
            "with_runs": [round(x, 1) for x in ruled],
        })  # fmt: skip
    result = {
        "model": args.model,
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
        f"\nstructured outputs, {args.model}, {args.dtype}, sampled, {args.new_tokens} new "
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
