"""Two builds of the CPU kernels side by side in one process: this checkout's and another's.

    python -m cdlm_serve.bench.kernel_ab --base DIR [--kinds bf16 int8] [--rounds 4]
                                         [--new-tokens 128] [--json out.json]

Decode speed on a 2-core box moves by 5-10% between processes (the memory bandwidth switches
levels), more than most kernel changes are worth; bench.quantized run once per tree cannot see
a 5% change. Here both builds run in one process: `DIR`'s sources of the build this machine
runs (AVX512 or AVX2, `models.kernels.BUILDS`) are compiled under another module name
(`DecodeStack` renamed so both load), SmolLM2 is loaded once per tree and kind in the order
base, new, new, base (ABBA, so where a copy of the weights sits in memory favours neither),
each copy's decode stack built with its tree's kernels, and greedy decoding of
`--new-tokens` tokens (ignore_eos) at batch 1 and 8 runs every copy in turn, each round
starting at the next copy. Reported: medians per tree and kind, new / base, and int8 / bf16
per tree. Only the fused decode step differs between the trees (prefill, argmax and the rest
are this checkout's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from cdlm_serve.bench.decode import PROMPT
from cdlm_serve.bench.quantized import _decode_tok_s
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.quantize import quantize_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

ROWS = (1, 8)
ORDER = ("base", "new", "new", "base")


def _engines(args: argparse.Namespace, builds: dict, tok, prompt: list[int]) -> dict:
    """(kind, tree, copy) -> an engine whose decode stack was built with `tree`'s kernels."""
    folder = resolve(args.model)
    engines = {}
    for kind in args.kinds:
        for copy, tree in enumerate(ORDER):
            model = load_model(folder, dtype=torch.bfloat16)[0]
            if kind == "int8":
                quantize_model(model)
            with kernels.extension(builds[tree]):  # the engine may build the stack at once
                engine = AREngine(model, tok, model.config.max_position_embeddings, max_batch=8)
                _decode_tok_s(engine, prompt, 1, 4)  # or its first step does
            stack = kernels.decode_stack(model)  # and it stays this tree's after the block
            if type(stack).__module__ != builds[tree].__name__:
                raise RuntimeError(f"{kind} {tree}: the stack came from {type(stack).__module__}")
            engines[(kind, tree, copy)] = engine
    return engines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout")
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--kinds", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    if not kernels.enable_cpu_kernels():
        raise SystemExit("the fused CPU kernels are not available here (no AVX2)")
    isa = kernels.active_isa()
    assert isa is not None
    names = kernels.BUILDS[isa][0]  # the same instruction set's build of the other checkout
    sources = [str(args.base / "models" / "kernels" / n) for n in names]
    builds = {
        "new": kernels._kernel,
        "base": kernels.build_extension(
            f"cdlm_cpu_{isa}_ab_base", sources, ("DecodeStack=DecodeStack_ab_base",), isa
        ),
    }
    tok = AutoTokenizer.from_pretrained(resolve(args.model))
    prompt = tok(PROMPT, add_special_tokens=False).input_ids[:32]
    engines = _engines(args, builds, tok, prompt)

    runs: dict = {key: {rows: [] for rows in ROWS} for key in engines}
    keys = list(engines)
    for r in range(args.rounds):
        for rows in ROWS:
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                runs[key][rows].append(_decode_tok_s(engines[key], prompt, rows, args.new_tokens))

    def median(kind: str, tree: str, rows: int) -> float:
        return statistics.median(
            x for (k, t, _), by in runs.items() if (k, t) == (kind, tree) for x in by[rows]
        )

    out: dict = {"base": str(args.base), "rounds": args.rounds, "new_tokens": args.new_tokens}
    out["copies"] = [  # each copy's own median: how far copies of one tree lie apart
        {
            "kind": k,
            "tree": t,
            "copy": c,
            **{f"batch{r}": round(statistics.median(by[r]), 1) for r in ROWS},
        }
        for (k, t, c), by in runs.items()
    ]
    for row in out["copies"]:
        print(
            f"{row['kind']} {row['tree']} copy {row['copy']}: "
            + ", ".join(f"{row[f'batch{r}']} tok/s at batch {r}" for r in ROWS)
        )
    print(f"\ndecode tok/s, medians of {args.rounds} rounds x 2 copies, one process")
    print(f"{'':12}{'base':>10}{'new':>10}{'new/base':>10}")
    for kind in args.kinds:
        for rows in ROWS:
            base, new = median(kind, "base", rows), median(kind, "new", rows)
            out[f"{kind}_batch{rows}"] = {"base": round(base, 1), "new": round(new, 1)}
            print(f"{kind + ' b' + str(rows):12}{base:>10.1f}{new:>10.1f}{new / base:>10.3f}")
    if set(args.kinds) == {"bf16", "int8"}:
        for tree in ("base", "new"):
            ratios = [median("int8", tree, r) / median("bf16", tree, r) for r in ROWS]
            out[f"int8_over_bf16_{tree}"] = [round(x, 2) for x in ratios]
            at = ", ".join(f"{x:.2f}x at batch {r}" for x, r in zip(ratios, ROWS, strict=True))
            print(f"int8/bf16 {tree}: {at}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
