"""Decode speed: our AR engine vs transformers' `generate`, side by side.

Same model (SmolLM2-135M-Instruct by default), same dtype, greedy, batch 1, a 32-token prompt
and 128 new tokens, runs interleaved (ours, HF, ours, HF, ...) so machine noise hits both;
medians are reported. Also prints the memory-bandwidth ceiling: weight bytes read per token
against the machine's measured read bandwidth.

    python -m cdlm_serve.bench.decode [--dtype bfloat16] [--runs 5] [--isa avx2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press into a system "
    "that could produce books quickly and cheaply."
)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer(PROMPT, add_special_tokens=False).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def read_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth of a large fp32 reduction (all threads)."""
    buf = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every matrix once (the embedding lookup reads one row, but
    a tied embedding is read whole as the LM head)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_ours(engine: AREngine, ids: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    n = sum(len(s.token_ids) for s in engine.generate(ids, params))
    elapsed = time.perf_counter() - t
    assert n == new_tokens, n
    return n / elapsed


def time_hf(hf, ids: list[int], new_tokens: int) -> float:
    inp = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            inp,
            attention_mask=torch.ones_like(inp),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=hf.config.eos_token_id,
        )
    elapsed = time.perf_counter() - t
    n = out.shape[1] - len(ids)
    assert n == new_tokens, n
    return n / elapsed


def decode_args(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    """The options of a decode-speed bench: model, dtype, prompt and answer lengths, runs."""
    parser.add_argument("--model", default=DEFAULT_AR_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--runs", type=int, default=3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decode_args(parser, new_tokens=128)
    parser.add_argument(
        "--isa",
        choices=["native", "avx2", "avx512"],
        default="native",
        help="the fused CPU kernels' instruction set (avx2 measures that path on any machine)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    folder = resolve(args.model)
    os.environ[kernels.ISA_ENV] = args.isa
    fused = kernels.enable_cpu_kernels()
    tok = AutoTokenizer.from_pretrained(folder)
    ours, _ = load_model(folder, dtype=dtype)
    engine = AREngine(ours, tok, max_model_len=ours.config.max_position_embeddings)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = prompt_ids(tok, args.prompt_tokens)

    time_ours(engine, ids, 8)  # warm-up: allocator, kernel caches
    time_hf(hf, ids, 8)
    ours_runs, hf_runs = [], []
    for _ in range(args.runs):
        ours_runs.append(time_ours(engine, ids, args.new_tokens))
        hf_runs.append(time_hf(hf, ids, args.new_tokens))

    ours_tok_s = statistics.median(ours_runs)
    hf_tok_s = statistics.median(hf_runs)
    bandwidth = read_bandwidth_gbs()
    per_token = weight_bytes_per_token(ours)
    ceiling = bandwidth * 1e9 / per_token
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu_kernels": fused,
        "isa": kernels.active_isa(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "ours_runs": [round(x, 2) for x in ours_runs],
        "hf_runs": [round(x, 2) for x in hf_runs],
        "ours_tok_s": round(ours_tok_s, 2),
        "hf_tok_s": round(hf_tok_s, 2),
        "ratio": round(ours_tok_s / hf_tok_s, 2),
        "weight_mb_per_token": round(per_token / 1e6, 1),
        "read_bandwidth_gbs": round(bandwidth, 1),
        "bandwidth_ceiling_tok_s": round(ceiling, 1),
    }
    print(
        f"\ndecode, {args.model}, {args.dtype}, batch 1, greedy, "
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
        f"{args.runs} interleaved runs (median), {torch.get_num_threads()} threads"
    )
    print(f"{'':24}{'tok/s':>8}   runs")
    print(f"{'ours':24}{ours_tok_s:>8.1f}   {result['ours_runs']}")
    print(f"{'transformers generate':24}{hf_tok_s:>8.1f}   {result['hf_runs']}")
    print(f"{'ratio':24}{result['ratio']:>8.2f}")
    print(
        f"bandwidth ceiling: {per_token / 1e6:.0f} MB of weights per token at "
        f"{bandwidth:.1f} GB/s measured read bandwidth = {ceiling:.0f} tok/s "
        f"(ours reaches {100 * ours_tok_s / ceiling:.0f}%, transformers "
        f"{100 * hf_tok_s / ceiling:.0f}%); fused CPU kernels: "
        f"{kernels.active_isa() if fused else 'off'}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
