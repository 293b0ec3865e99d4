"""int8 (Q8_0) weights against bf16, side by side on one model: decode speed and quality.

    python -m cdlm_serve.bench.quantized [--runs 5] [--new-tokens 128] [--ppl-tokens 1024]
                                         [--json out.json]

Two copies of SmolLM2-135M-Instruct (bf16 on the CPU, fused kernels on), one quantized with
`--quantize int8`'s code (models/quantize.py). Speed: greedy decoding of 128 new tokens after
a 32-token prompt, at batch 1 and with 8 sequences decoding together, runs interleaved
(bf16, int8, bf16, ...) so machine noise hits both, medians. Quality: perplexity of held-out
Austen (*Persuasion*, held out of our own training data; SmolLM2 may have seen it) computed the
way the server decodes, one token per step through the fused step (int8 weights and int8
activations for the quantized copy), over windows of 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from cdlm_serve.bench.decode import PROMPT
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.quantize import quantize_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve
from cdlm_serve.train.data import EVAL_NOVEL


def _decode_tok_s(engine: AREngine, prompt: list[int], rows: int, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        engine.add(engine.new_sequence(f"r{i}", prompt[i:] + prompt[:i], params))
    produced = 0
    started = time.perf_counter()
    while engine.has_work():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - started)


@torch.inference_mode()
def _perplexity(model: torch.nn.Module, ids: list[int], window: int) -> float:
    """exp(mean NLL) of ids, each window decoded token by token through the runner."""
    runner = ModelRunner(model)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        cache = model.new_cache(1, window + 1)
        for i in range(window - 1):
            hidden = runner.extend([(0, [chunk[i]])], cache)
            logp = torch.log_softmax(model.logits(hidden).float(), dim=-1)
            nll -= float(logp[0, chunk[i + 1]])
            count += 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not 2 <= args.window <= args.ppl_tokens:
        p.error("--window must be at least 2 and at most --ppl-tokens")

    from transformers import AutoTokenizer

    from cdlm_serve.train import austen

    if not kernels.enable_cpu_kernels():
        raise SystemExit("the fused CPU kernels (AVX2 or AVX512) are needed for int8 decoding")
    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    bf16 = load_model(folder, dtype=torch.bfloat16)[0]
    int8 = load_model(folder, dtype=torch.bfloat16)[0]
    quantize_model(int8)
    models = {"bf16": bf16, "int8": int8}
    limit = bf16.config.max_position_embeddings
    engines = {name: AREngine(m, tok, limit, max_batch=8) for name, m in models.items()}
    prompt = tok(PROMPT, add_special_tokens=False).input_ids[:32]

    speed: dict[str, dict[int, list[float]]] = {name: {1: [], 8: []} for name in models}
    for engine in engines.values():  # warm-up: allocator, kernel caches
        _decode_tok_s(engine, prompt, 1, 8)
    for _ in range(args.runs):
        for rows in (1, 8):
            for name, engine in engines.items():
                speed[name][rows].append(_decode_tok_s(engine, prompt, rows, args.new_tokens))

    text = austen.load(EVAL_NOVEL).replace("\n", " ")
    ids = tok(text, add_special_tokens=False).input_ids[: args.ppl_tokens]
    ppl = {name: _perplexity(m, ids, args.window) for name, m in models.items()}

    out: dict = {"model": args.model, "runs": args.runs, "new_tokens": args.new_tokens}
    for name in models:
        out[name] = {
            "tok_s_batch1": round(statistics.median(speed[name][1]), 1),
            "tok_s_batch8": round(statistics.median(speed[name][8]), 1),
            "runs_batch1": [round(x, 1) for x in speed[name][1]],
            "runs_batch8": [round(x, 1) for x in speed[name][8]],
            "perplexity": round(ppl[name], 4),
        }
    out["speedup_batch1"] = round(out["int8"]["tok_s_batch1"] / out["bf16"]["tok_s_batch1"], 2)
    out["speedup_batch8"] = round(out["int8"]["tok_s_batch8"] / out["bf16"]["tok_s_batch8"], 2)
    out["perplexity_change"] = round(ppl["int8"] / ppl["bf16"] - 1, 4)
    print(
        f"\nint8 vs bf16: {args.model}, greedy decode of {args.new_tokens} tokens, "
        f"{args.runs} interleaved runs (median); perplexity of {len(ids)} held-out Austen "
        f"tokens decoded step by step ({args.window}-token windows)"
    )
    print(f"{'':8}{'batch 1 tok/s':>15}{'batch 8 tok/s':>15}{'perplexity':>12}")
    for name in models:
        s = out[name]
        print(
            f"{name:8}{s['tok_s_batch1']:>15.1f}{s['tok_s_batch8']:>15.1f}{s['perplexity']:>12.3f}"
        )
    print(
        f"int8/bf16: {out['speedup_batch1']}x at batch 1, {out['speedup_batch8']}x at batch 8; "
        f"perplexity {100 * out['perplexity_change']:+.2f}%"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
