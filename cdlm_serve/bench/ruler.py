"""KV compaction on RULER's synthetic tasks: each method's score per task, at each ratio, with
the uncompressed model as the ceiling.

    python -m cdlm_serve.bench.ruler [--model smollm2-135m-instruct] [--lengths 4096 8192]
        [--samples 4] [--tasks niah_single_1 ... vt cwe] [--ratios 2 4 10 20]
        [--methods kvzip+global am-omp+measured ...] [--peer kvpress] [--json out.json]
    python -m cdlm_serve.bench.ruler --summarize a.json b.json [--json merged.json]

The tasks are RULER's, generated here (bench/ruler_tasks.py says how and where they differ).
Each sample is rendered with the model's chat template and cut where a session would be: the
instruction and the haystack (the context, prefilled once), then the question, the assistant's
turn header and RULER's answer prefix. Every method compacts a copy of the context's cache to the
same physical size round(T / ratio), as bench/compaction.py does (ours keep the last
`--keep-recent` context tokens exact inside it; kvpress's presses compress the whole context), and
the model answers greedily (RULER's tokens_to_generate at most, ending at the end of its turn).
A score is RULER's string_match_all x 100: the share of the expected strings in the answer.

The table gives, per length, ratio and method, each task's mean score over `--samples` samples
and their average; "full" is the uncompressed cache. Every sample and answer is in the JSON.
Which samples a run draws depends on `--seed` alone, so runs split by `--tasks` or `--methods`
score the same samples, and a run with another seed scores others (merge them with
`--summarize`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cdlm_serve.bench import kvpress_peer
from cdlm_serve.bench.compaction import (
    capture_references,
    compact_copy,
    load_bench_model,
    long_text,
    method_spec,
    save_json,
)
from cdlm_serve.bench.facts import sequence_start
from cdlm_serve.bench.ruler_tasks import TASKS, Generator, Render, Sample, string_match_all
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.sources import DEFAULT_AR_MODEL

FULL = "full"  # the uncompressed row: the ceiling
METHODS = (
    "am-omp+measured",
    "am-highest-fast",
    "kvzip",
    "kvzip+global",
    "snapkv",
    "h2o",
    "expected_attention",
    "streaming",
)


def chat_render(tok: Any) -> Render:
    """A sample as the model's chat template renders it (a raw prompt where the tokenizer has
    no template), cut after the context: (context ids, question ids). The question's part
    holds the end of the user's turn, the assistant's header and the answer prefix."""

    def render(sample: Sample) -> tuple[list[int], list[int]]:
        user = f"{sample.context}\n{sample.question}"
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            cut = text.index(user) + len(sample.context)
            head, tail = text[:cut], text[cut:]
            start: list[int] = []
        else:
            head, tail = sample.context, user[len(sample.context) :]
            start = sequence_start(tok)
        encode = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        return start + encode(head), encode(tail + sample.answer_prefix)

    return render


def stop_ids(tok: Any) -> set[int]:
    """The tokens that end the assistant's answer: EOS and the chat template's end of turn."""
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for marker in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        ids = tok.convert_tokens_to_ids(marker)
        if isinstance(ids, int) and ids != tok.unk_token_id:
            stops.add(ids)
    return stops


@torch.no_grad()
def answers(
    model: Any,
    tok: Any,
    caches: list[KVCache],
    question: list[int],
    sample: Sample,
    stop: set[int] | None = None,
) -> list[str]:
    """Each cache's greedy answer to `question` (copies: the caches are not changed), decoded
    as one batch, the answers as each cache gives them alone (tests/test_ruler.py): a sample's
    methods of one ratio answer together (4 caches of a 1.5K context, 128 tokens each: 28 s,
    against 40 s one at a time; 2 cores, fp32). Each row ends at a stop token or after the
    sample's `max_new_tokens`. `stop`: the stop tokens (default: the tokenizer's, `stop_ids`)."""
    n, stop = sample.max_new_tokens, stop_ids(tok) if stop is None else stop
    batch = model.new_cache(len(caches), max(c.lengths[0] for c in caches) + len(question) + n + 1)
    for row, cache in enumerate(caches):
        batch.load_row(row, cache)
    runner = ModelRunner(model)
    hidden = runner.extend([(row, question) for row in range(len(caches))], batch)  # [B, hidden]
    out: list[list[int]] = [[] for _ in caches]
    live = list(range(len(caches)))
    for _ in range(n):
        steps = []
        for row, token in zip(live, model.logits(hidden).argmax(-1).tolist(), strict=True):
            if token not in stop:
                out[row].append(token)
                steps.append((row, [token]))
        if not steps or len(out[steps[0][0]]) == n:
            break
        live = [row for row, _ in steps]
        hidden = runner.extend(steps, batch)
    return [tok.decode(ids, skip_special_tokens=True) for ids in out]


def run_sample(
    model: Any, tok: Any, hf: Any, sample: Sample, render: Render, args: argparse.Namespace
) -> list[dict]:
    """Every method at every ratio on one sample, and the uncompressed ceiling: one row each."""
    context, question = render(sample)
    full = model.new_cache(1, len(context) + len(question) + sample.max_new_tokens + 1)
    with torch.no_grad():
        model(torch.tensor([context], device=model.device), cache=full)
    captured = capture_references(model, tok, full, context, args.methods)
    hf_prefill_s = kvpress_peer.prefill_seconds(hf, context) if hf is not None else 0.0
    base = {"task": sample.task, "tokens": len(context) + len(question)}
    (said,) = answers(model, tok, [full], question, sample)
    rows = [{**base, "method": FULL, "ratio": 1.0, "physical": len(context), "answer": said}]
    rows[0].update(answers=list(sample.answers), depths=list(sample.depths), seconds=0.0)
    for ratio in args.ratios:
        slots = round(len(context) / ratio)
        if slots - args.keep_recent < 1 or not args.methods:
            continue
        caches, done = [], []
        for method in args.methods:
            cache, report = compact_copy(
                model, tok, hf, full, context, slots, method, args, captured, hf_prefill_s
            )
            caches.append(cache)
            done.append(
                {
                    **base,
                    "method": method,
                    "ratio": ratio,
                    "physical": cache.lengths[0],
                    "seconds": report.seconds["total"],
                }
            )
        for row, said in zip(done, answers(model, tok, caches, question, sample), strict=True):
            rows.append({**row, "answer": said})
    for row in rows:
        row["score"] = 100.0 * string_match_all(row["answer"], sample.answers)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean score per (length, method, ratio, task) and over tasks; printed as one table per
    length (tasks as columns), the ceiling first."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        tasks = [t for t in TASKS if any(r["task"] == t for r in at)]
        methods = list(dict.fromkeys(r["method"] for r in at))
        ratios = sorted({r["ratio"] for r in at if r["method"] != FULL})
        samples = max(len({(r["seed"], r["sample"]) for r in at if r["task"] == t}) for t in tasks)
        width = max(20, *(len(m) + 2 for m in methods))
        print(f"\nRULER at {length} tokens: score per task (mean of up to {samples} samples)")
        print(
            f"{'ratio':>6} {'method':<{width}}"
            + "".join(f"{_short(t):>8}" for t in tasks)
            + f"{'avg':>8}"
        )
        for ratio in [1.0, *ratios]:
            for method in methods:
                if (method == FULL) != (ratio == 1.0):
                    continue
                scores = {}
                for t in tasks:
                    got = [
                        r["score"]
                        for r in at
                        if r["method"] == method and r["ratio"] == ratio and r["task"] == t
                    ]
                    if got:
                        scores[t] = statistics.mean(got)
                if not scores:
                    continue
                avg = statistics.mean(scores.values())
                cells = "".join(f"{scores[t]:>8.1f}" if t in scores else f"{'-':>8}" for t in tasks)
                label = "1x" if ratio == 1.0 else f"{ratio:.0f}x"
                print(f"{label:>6} {method:<{width}}{cells}{avg:>8.1f}")
                out.append(
                    {
                        "length": length,
                        "method": method,
                        "ratio": ratio,
                        "tasks": scores,
                        "average": avg,
                    }
                )
    return out


def _short(task: str) -> str:
    """A column's name: niah_multikey_2 -> mk2."""
    return (
        task.replace("niah_", "")
        .replace("single_", "s")
        .replace("multikey_", "mk")
        .replace("multivalue", "mv")
        .replace("multiquery", "mq")
    )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--samples", type=int, default=4, help="samples per task and length")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 10, 20])
    p.add_argument(
        "--methods",
        nargs="*",
        default=list(METHODS),
        help="as bench/compaction.py's --methods (METHOD[:SOURCE][+flags]), or kvpress:<press>; "
        "none: the uncompressed ceiling alone",
    )
    p.add_argument("--peer", choices=["kvpress"], help="add kvpress's default presses as rows")
    p.add_argument("--keep-recent", type=int, default=64)
    p.add_argument("--text", help="the essay haystack's text (default: Jane Austen)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print (and with --json write) the tables of earlier runs, run nothing",
    )
    args = p.parse_args(argv)
    if args.peer == "kvpress":
        args.methods += [kvpress_peer.PREFIX + n for n in kvpress_peer.DEFAULT_PRESSES]
    for m in args.methods:
        if kvpress_peer.is_peer(m):
            kvpress_peer.press_name(m)  # an unknown press fails now
        else:
            method_spec(m)
    if args.summarize:
        rows = [r for f in args.summarize for r in json.loads(f.read_text())["rows"]]
        summary = summarize(rows)
        if args.json:
            save_json(args.json, {"rows": rows, "summary": summary})
        return rows

    folder, tok, model = load_bench_model(args.model, args.dtype)
    peers = any(kvpress_peer.is_peer(m) for m in args.methods)
    hf = kvpress_peer.load_hf(folder, getattr(torch, args.dtype)) if peers else None
    render = chat_render(tok)
    generator = Generator(long_text(args.text))
    rows: list[dict] = []
    for length in args.lengths:
        for task in args.tasks:
            # one stream per (length, task, sample): a run of some tasks draws what a run of
            # all draws
            for s in range(args.samples):
                rng = random.Random(f"{args.seed}:{length}:{task}:{s}")
                sample = generator.sample(task, length, render, rng)
                started = time.perf_counter()
                got = run_sample(model, tok, hf, sample, render, args)
                for row in got:
                    row.update(length=length, sample=s, seed=args.seed)
                rows += got
                _print_sample(got, time.perf_counter() - started)
                if args.json:  # after every sample, so a stopped run keeps what it measured
                    save_json(args.json, {"rows": rows})
    summary = summarize(rows)
    if args.json:
        save_json(args.json, {"rows": rows, "summary": summary})
    return rows


def _print_sample(rows: list[dict], seconds: float) -> None:
    head = rows[0]
    print(
        f"{head['task']} #{head['sample']} at {head['length']} ({head['tokens']} tokens, "
        f"{seconds:.0f}s): full {head['score']:.0f} {head['answer'][:60]!r}",
        flush=True,
    )
    for r in rows[1:]:
        print(
            f"  {r['ratio']:>4.0f}x {r['method']:<24} {r['score']:>5.0f}  {r['answer'][:60]!r}",
            flush=True,
        )


if __name__ == "__main__":
    main()
