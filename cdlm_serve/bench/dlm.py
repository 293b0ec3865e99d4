"""Diffusion decoding, side by side: vanilla vs fast_dllm vs cdlm (the paper's Table 1).

    python -m cdlm_serve.bench.dlm [--limit N] [--variant NAME=DIR ...] [--json out.json]
    python -m cdlm_serve.bench.dlm --model DIR --prompts FILE.jsonl [--cdlm-model DIR]
                                   [--json out.json]
    python -m cdlm_serve.bench.dlm --per-step [--json out.json]
    python -m cdlm_serve.bench.dlm --kernels-vs-fp32 [--isa avx2] [--text-limit 8] [--json out.json]
    python -m cdlm_serve.bench.dlm --grammar [--limit N] [--batch B] [--json out.json]

With no model arguments it evaluates the shipped teacher (vanilla, fast_dllm) and student
(cdlm) on our held-out suites: see bench/cdlm_suites.py. Otherwise each JSONL line is
{"prompt": ..., "reference": ... (optional)}. Every prompt is decoded alone (batch 1) by each
decoder in turn, so machine noise hits all three alike, each to the same length (`ignore_eos`;
the text scored ends at the first end-of-text), twice: each decoder on its fastest path (the
fused CPU kernels where this CPU has them), then all on the same PyTorch path. Reported per
decoder: median latency per answer, mean steps (forward passes), tokens/s, and exact match (%)
against the references where they exist. vanilla and fast_dllm run `--model` (the bidirectional
teacher); cdlm runs `--cdlm-model` (the block-causal student), or `--model` if none is given.

`--kernels-vs-fp32` runs the student (cdlm decoding) on held-out prose twice per prompt,
interleaved: in bf16 on the fused CPU kernels (of `--isa`), and in float32 on PyTorch's ops,
the path a CPU without the kernels takes; reported: each path's tokens/s and their ratio.

`--grammar` measures what structured outputs cost a diffusion model: the student (cdlm) on the
first `--limit` held-out problems of each task suite, unconstrained and under a regex of the
suite's answer format (`cdlm_suites.ANSWER_FORMATS`), in both orders a grammar may commit in
(`engine.decoding.dlm_grammar`: "any", the default, and "leftmost"); decoded `--batch` at a
time, the rows interleaved per batch. Reported per row and suite: steps per answer (forward
passes, the prefill included; median and mean), tokens per step, exact match and answers that
match the format (%), and seconds per answer (the batch's time over its answers, median).

`--per-step` measures what one step costs: a cached CDLM block step (B new tokens against a
cache holding the prompt and the answer so far) vs a full-recompute step (prompt + whole answer,
bidirectional), on a random LLaDA-format model, at answer lengths 64 and 256.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cdlm_serve.bench import cdlm_suites
from cdlm_serve.engine.decoding import DLMEngine, GenerationOptions, GrammarSpec
from cdlm_serve.models import kernels
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import resolve
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.train.data import KINDS, held_out_prose
from cdlm_serve.train.tasks import TASKS, exact_match


@dataclass(slots=True)
class Item:
    prompt: str
    reference: str | None


def read_prompts(path: Path, limit: int | None) -> list[Item]:
    items = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            items.append(Item(row["prompt"], row.get("reference")))
    return items[:limit] if limit else items


def run_table(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    kernels.enable_cpu_kernels()
    teacher = cdlm_suites.engine_for(Path(args.model), dtype, batch=1)
    student = teacher
    if args.cdlm_model is not None:
        student = cdlm_suites.engine_for(Path(args.cdlm_model), dtype, batch=1)
    rows = [
        cdlm_suites.Row(d, student if d == "cdlm" else teacher, d)
        for d in ("vanilla", "fast_dllm", "cdlm")
    ]
    items = read_prompts(args.prompts, args.limit)
    runs, same_path = cdlm_suites.both_paths(rows, [item.prompt for item in items], args)
    result = {}
    for decoding, done in runs.items():
        scored = [
            exact_match(text, item.reference)
            for (*_, text), item in zip(done, items, strict=True)
            if item.reference is not None
        ]
        result[decoding] = {
            **cdlm_suites.speed(done),
            "same_path": same_path[decoding],
            "score": round(100 * sum(scored) / len(scored), 2) if scored else None,
        }
    _print_table(result, len(items), args)
    cdlm_suites.print_same_path(same_path, args.dtype)
    return result


def _print_table(result: dict, n: int, args: argparse.Namespace) -> None:
    base = result["vanilla"]
    print(f"\n{n} prompts, max_tokens {args.max_tokens}, dtype {args.dtype}, batch 1")
    print(f"{'decoder':<11}{'latency (median)':>18}{'steps (mean)':>16}{'tok/s':>10}{'score':>8}")
    for decoding in ("vanilla", "fast_dllm", "cdlm"):
        r = result[decoding]
        speedup = f" ({base['latency_s'] / r['latency_s']:.1f}x)" if decoding != "vanilla" else ""
        fewer = f" ({base['steps'] / r['steps']:.1f}x)" if decoding != "vanilla" else ""
        score = "-" if r["score"] is None else f"{r['score']:.1f}"
        print(
            f"{decoding:<11}{r['latency_s']:>11.3f} s{speedup:>7}{r['steps']:>9.1f}{fewer:>7}"
            f"{r['tok_s']:>10.1f}{score:>8}"
        )


# ---- structured outputs -----------------------------------------------------------------------
GRAMMAR_ROWS = ("unconstrained", "regex", "regex, leftmost")


def _grammar_batch(engine: DLMEngine, suite: str, problems: list, row: str) -> list[dict]:
    """One batch of problems decoded together in `row`'s way; per answer: steps, tokens,
    exact match, format match, seconds (the batch's over its answers)."""
    regex = cdlm_suites.ANSWER_FORMATS[suite]
    spec = None if row == "unconstrained" else GrammarSpec("regex", regex)
    engine.grammar_order = "leftmost" if row.endswith("leftmost") else "any"
    started = time.perf_counter()
    for i, ex in enumerate(problems):
        params = engine.params(GenerationOptions(grammar=spec), KINDS[suite].answer_len, None)
        ids = engine.tokenizer.encode(ex.prompt, add_special_tokens=False)
        engine.add(engine.new_sequence(str(i), ids, params))
    texts = {str(i): "" for i in range(len(problems))}
    done: dict[str, tuple[int, int]] = {}
    tokens = dict.fromkeys(texts, 0)
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id] += out.text
            tokens[out.request_id] += len(out.token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = (out.steps or 0, tokens[out.request_id])
    seconds = (time.perf_counter() - started) / len(problems)
    return [
        {
            "steps": done[str(i)][0],
            "tokens": done[str(i)][1],
            "exact": exact_match(texts[str(i)], ex.answer),
            "format": re.fullmatch(regex, texts[str(i)].strip()) is not None,
            "seconds": seconds,
        }
        for i, ex in enumerate(problems)
    ]


def run_grammar(args: argparse.Namespace) -> dict:
    kernels.enable_cpu_kernels()
    engine = cdlm_suites.engine_for(resolve(args.student), getattr(torch, args.dtype), args.batch)
    result: dict[str, dict] = {}
    for suite in cdlm_suites.SUITES:
        problems = list(TASKS[suite].held_out()[: args.limit])
        _grammar_batch(engine, suite, problems[:4], "regex")  # warm-up: the grammar compiled
        answers: dict[str, list[dict]] = {row: [] for row in GRAMMAR_ROWS}
        for start in range(0, len(problems), args.batch):
            for row in GRAMMAR_ROWS:
                answers[row] += _grammar_batch(
                    engine, suite, problems[start : start + args.batch], row
                )
        result[suite] = {row: _grammar_summary(done) for row, done in answers.items()}
    _print_grammar(result, args)
    return {"limit": args.limit, "batch": args.batch, "dtype": args.dtype, "suites": result}


def _grammar_summary(done: list[dict]) -> dict:
    steps = [d["steps"] for d in done]
    return {
        "answers": len(done),
        "steps_median": statistics.median(steps),
        "steps_mean": round(statistics.mean(steps), 2),
        "tokens_per_step": round(sum(d["tokens"] for d in done) / sum(steps), 2),
        "exact_match": round(100 * sum(d["exact"] for d in done) / len(done), 1),
        "format_match": round(100 * sum(d["format"] for d in done) / len(done), 1),
        "seconds_median": round(statistics.median(d["seconds"] for d in done), 4),
    }


def _print_grammar(result: dict, args: argparse.Namespace) -> None:
    print(
        f"\nstructured outputs on the cdlm student ({args.dtype}): the first {args.limit} "
        f"held-out problems per suite, {args.batch} at a time, unconstrained vs a regex of the "
        "answer format"
    )
    print(
        f"{'suite':<11}{'decoding':<17}{'steps med':>10}{'mean':>7}{'tok/step':>9}"
        f"{'EM %':>7}{'format %':>9}{'ms/answer':>10}"
    )
    for suite, rows in result.items():
        for row, r in rows.items():
            print(
                f"{suite:<11}{row:<17}{r['steps_median']:>10}{r['steps_mean']:>7.2f}"
                f"{r['tokens_per_step']:>9.2f}{r['exact_match']:>7.1f}{r['format_match']:>9.1f}"
                f"{1e3 * r['seconds_median']:>10.1f}"
            )


# ---- per-step cost ---------------------------------------------------------------------------
def _random_llada(folder: Path, layers: int, width: int) -> None:
    """A random LLaDA-format checkpoint of a chosen size (no tokenizer needed here)."""
    from safetensors.torch import save_file

    from cdlm_serve.models.config import ModelConfig
    from cdlm_serve.models.weights import to_checkpoint

    cfg = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": width,
        "n_heads": width // 64,
        "n_kv_heads": width // 64,
        "n_layers": layers,
        "mlp_hidden_size": 3 * width,
        "vocab_size": 4096,
        "embedding_size": 4096,
        "weight_tying": False,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 4096,
        "mask_token_id": 4095,
        "eos_token_id": 4094,
    }
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf_dict(cfg))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in model.state_dict().items()}
    save_file(to_checkpoint(sd, model.config), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def run_per_step(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    kernels.enable_cpu_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        _random_llada(Path(tmp), args.layers, args.width)
        model, _ = load_model(tmp, dtype=dtype)
    prompt, block = args.prompt_tokens, args.block_size or 32
    ratios, rows = {}, []
    for answer in (64, 256):
        ids = torch.randint(
            0, 4000, (1, prompt + answer), generator=torch.Generator().manual_seed(1)
        )
        full = _median_time(
            lambda ids=ids: model(ids, pattern=AttentionPattern.bidirectional()), args.repeats
        )
        # The costliest cached step: the answer's last block, with everything before it cached.
        pattern = AttentionPattern.block_causal(block, prompt)
        cache = model.new_cache(1, prompt + answer + block)
        model(ids[:, : prompt + answer - block], cache=cache, pattern=pattern)
        last = ids[:, prompt + answer - block :]
        cached = _median_time(
            lambda last=last, cache=cache, pattern=pattern: model(
                last, cache=cache, pattern=pattern, commit=False
            ),
            args.repeats,
        )
        ratios[str(answer)] = round(full / cached, 2)
        rows.append((answer, full, cached))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"\nper-step cost, random LLaDA-format model ({n_params / 1e6:.1f}M params, "
        f"{args.layers} layers, d={args.width}), {args.dtype}, prompt {prompt}, block {block}"
    )
    print(f"{'answer':>8}{'full recompute':>17}{'cached block':>15}{'ratio':>8}")
    for answer, full, cached in rows:
        print(f"{answer:>8}{full * 1e3:>14.2f} ms{cached * 1e3:>12.2f} ms{full / cached:>7.1f}x")
    return {
        "per_step_ratio": ratios,
        "full_ms": {str(a): round(f * 1e3, 3) for a, f, _ in rows},
        "cached_ms": {str(a): round(c * 1e3, 3) for a, _, c in rows},
    }


def run_kernels_vs_fp32(args: argparse.Namespace) -> dict:
    """The student on the fused kernels (bf16) against float32 on PyTorch's ops, interleaved
    per prompt so that machine noise hits both alike."""
    os.environ[kernels.ISA_ENV] = args.isa
    if not kernels.enable_cpu_kernels():
        raise SystemExit("no fused CPU kernels on this machine (or this --isa)")
    folder = resolve(args.student)
    fused = cdlm_suites.Row("fused", cdlm_suites.engine_for(folder, torch.bfloat16, 1), "cdlm")
    eager = cdlm_suites.Row("eager", cdlm_suites.engine_for(folder, torch.float32, 1), "cdlm")
    prompts = [p for p, _ in held_out_prose(args.text_limit or 8)]
    cdlm_suites.text_run(fused, prompts[0], args)  # warm-up: kernels, allocator
    runs: dict[str, list[tuple]] = {"fused": [], "eager": []}
    for prompt in prompts:
        runs["fused"].append(cdlm_suites.text_run(fused, prompt, args))
        with kernels.cpu_kernels(False):
            runs["eager"].append(cdlm_suites.text_run(eager, prompt, args))
    speeds = {name: cdlm_suites.speed(done) for name, done in runs.items()}
    ratio = round(speeds["fused"]["tok_s"] / speeds["eager"]["tok_s"], 2)
    isa = kernels.active_isa()
    print(
        f"\ncdlm student, {len(prompts)} held-out prompts x {args.max_tokens} tokens, batch 1, "
        f"{torch.get_num_threads()} threads, interleaved"
    )
    print(f"{'path':<34}{'latency':>10}{'steps':>8}{'tok/s':>8}")
    for name, label in (("fused", f"bf16, fused kernels ({isa})"), ("eager", "float32, PyTorch")):
        r = speeds[name]
        print(f"{label:<34}{r['latency_s']:>8.2f} s{r['steps']:>8.1f}{r['tok_s']:>8.1f}")
    print(f"{'fused / float32':<34}{'':>18}{ratio:>8.2f}x")
    return {"isa": isa, **speeds, "ratio": ratio, "prompts": len(prompts)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="DLM folder for vanilla and fast_dllm (the teacher)")
    parser.add_argument("--cdlm-model", help="DLM folder for cdlm (the student)")
    parser.add_argument("--prompts", type=Path, help="JSONL: prompt, optional reference")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--per-step", action="store_true", help="measure one step's cost")
    parser.add_argument(
        "--kernels-vs-fp32",
        action="store_true",
        help="the student in bf16 on the fused kernels vs float32 on PyTorch, side by side",
    )
    parser.add_argument(
        "--grammar",
        action="store_true",
        help="the student under a regex of each task's answer format vs unconstrained",
    )
    parser.add_argument("--isa", choices=["native", "avx2", "avx512"], default="native")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    suites = parser.add_argument_group("the shipped models on the held-out suites (the default)")
    suites.add_argument("--teacher", default="cdlm-teacher", help="name or folder")
    suites.add_argument("--student", default="cdlm-student", help="name or folder")
    suites.add_argument(
        "--variant", action="append", help="NAME=FOLDER: another student to run with cdlm"
    )
    suites.add_argument("--text-limit", type=int, help="text-suite prompts (default: --limit)")
    suites.add_argument("--batch", type=int, default=32, help="batch for the task suites")
    args = parser.parse_args(argv)
    if args.per_step:
        result = run_per_step(args)
    elif args.kernels_vs_fp32:
        result = run_kernels_vs_fp32(args)
    elif args.grammar:
        args.limit = args.limit or 200
        result = run_grammar(args)
    elif args.model or args.prompts:
        if not (args.model and args.prompts):
            parser.error("--model and --prompts go together")
        result = run_table(args)
    else:
        args.limit = args.limit or 500
        args.text_limit = args.text_limit or min(args.limit, 100)
        result = cdlm_suites.run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
