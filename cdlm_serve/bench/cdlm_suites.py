"""The CDLM evaluation on our own held-out suites (what `python -m cdlm_serve.bench.dlm` runs
by default).

Rows: the teacher with vanilla decoding (one token per step, full recompute), the teacher with
fast_dllm, the student with cdlm, and any extra students (ablations) with cdlm too.

- Exact-match suites (`train.tasks`: addition3, trace4): the first `--limit` held-out problems,
  decoded in batches (each answer is identical to decoding it alone; tests/test_dlm_engine.py),
  scored by exact match; `score` is the mean over the suites.
- Text suite: held-out Austen paragraphs (a novel never trained on) continued for
  `--max-tokens` tokens, one prompt at a time and each row in turn, so machine noise hits all
  rows alike. `latency_s` (median), `steps` (mean) and `tok_s` come from here, as in the paper's
  256-token generations. `gen_ppl` is the perplexity of the continuation given its prompt under
  SmolLM2-135M (MDLM and SEDD use GPT-2 the same way), `entropy` the mean unigram entropy of the
  continuation's SmolLM2 tokens (repetition lowers it); the true continuations are scored too.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
from cdlm_serve.engine.served_model import load_tokenizer
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.train.data import KINDS, held_out_prose
from cdlm_serve.train.teacher import solve_held_out

SUITES = ("addition3", "trace4")
# Each suite's answer format as a regex (for structured outputs: `dlm --grammar`): addition's
# column steps `d+d+c=dd,` then `=` and the 3- or 4-digit sum; trace's four statements, each
# echoed (4 characters) and valued.
ANSWER_FORMATS = {
    "addition3": r"([0-9]\+[0-9]\+[01]=[0-9]{2},){3}=[0-9]{3,4}",
    "trace4": "".join(rf"{v}=[a-d0-9+\- ]{{4}}=[0-9];" for v in "abcd"),
}


@dataclass(slots=True)
class Row:
    name: str
    engine: DLMEngine
    decoding: str


def engine_for(folder: Path, dtype: torch.dtype, batch: int) -> DLMEngine:
    model, ckpt = load_model(folder, dtype=dtype)
    tok = load_tokenizer(ckpt.tokenizer_folder or folder)
    return DLMEngine(model, tok, model.config.max_position_embeddings, max_batch=batch)


def _params(engine: DLMEngine, decoding: str, max_tokens: int, args: Any) -> DLMParams:
    return DLMParams(
        max_tokens=max_tokens,
        decoding=decoding,  # type: ignore[arg-type]
        block_size=args.block_size or engine.block_size,
        threshold=engine.threshold if args.threshold is None else args.threshold,
    )


def task_scores(row: Row, limit: int, args: Any) -> tuple[dict[str, float], float]:
    """Exact match (%) per suite, and mean steps per answer over both."""
    scores, steps = {}, []
    for suite in SUITES:
        params = _params(row.engine, row.decoding, KINDS[suite].answer_len, args)
        em, mean_steps = solve_held_out(
            row.engine, suite, limit, params.block_size, row.decoding, params.threshold
        )
        scores[suite] = round(em, 2)
        steps.append(mean_steps)
    return scores, statistics.mean(steps)


def text_run(row: Row, prompt: str, args: Any) -> tuple:
    """(latency, steps, tokens, text) of one prompt decoded alone, to `--max-tokens`
    (ignore_eos); the text scored is the answer up to its first end-of-text token."""
    engine = row.engine
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    params = _params(engine, row.decoding, args.max_tokens, args)
    params.ignore_eos = True
    started = time.perf_counter()
    outs = list(engine.generate(ids, params))
    latency = time.perf_counter() - started
    answer = [t for o in outs for t in o.token_ids]
    end = next((i for i, t in enumerate(answer) if t in engine.eos_token_ids), None)
    text = engine.tokenizer.decode(answer[:end], skip_special_tokens=True)
    return latency, outs[-1].steps, len(answer), text


def text_runs(rows: list[Row], prompts: list[str], args: Any) -> dict[str, list[tuple]]:
    """Per row, `text_run` of each prompt; rows interleaved per prompt."""
    runs: dict[str, list[tuple]] = {r.name: [] for r in rows}
    for prompt in prompts:
        for row in rows:
            runs[row.name].append(text_run(row, prompt, args))
    return runs


def speed(done: list[tuple]) -> dict[str, float]:
    """Median latency, mean steps and tokens/s of one row's text runs."""
    return {
        "latency_s": round(statistics.median(r[0] for r in done), 4),
        "steps": round(statistics.mean(r[1] for r in done), 2),
        "tok_s": round(sum(r[2] for r in done) / sum(r[0] for r in done), 2),
    }


def both_paths(rows: list[Row], prompts: list[str], args: Any) -> tuple[dict, dict]:
    """The text runs, batch 1, every answer `--max-tokens` long so that every decoder does the
    same work, on two paths: each decoder on its fastest (the fused CPU kernels wherever they
    apply: every step of up to `FUSED_STEP_TOKENS` tokens, in every mode) and every decoder on
    the same (PyTorch) path. Interleaved (per prompt, per row, both paths one after the other)
    so that machine noise hits all alike. Returns (fastest runs, same-path speeds)."""
    fastest: dict[str, list[tuple]] = {r.name: [] for r in rows}
    same: dict[str, list[tuple]] = {r.name: [] for r in rows}
    for prompt in prompts:
        for row in rows:
            fastest[row.name].append(text_run(row, prompt, args))
            with kernels.cpu_kernels(False):
                same[row.name].append(text_run(row, prompt, args))
    return fastest, {name: speed(done) for name, done in same.items()}


class Judge:
    """SmolLM2-135M as the scorer of generated prose."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        folder = resolve(DEFAULT_AR_MODEL)
        self.model: Transformer
        self.model, _ = load_model(folder, dtype=dtype)
        self.tok = load_tokenizer(folder)

    @torch.inference_mode()
    def nll(self, prompt: str, continuation: str) -> tuple[float, int]:
        """Summed NLL of the continuation's tokens given the prompt, and their count."""
        p = self.tok.encode(prompt, add_special_tokens=False)
        c = self.tok.encode(continuation, add_special_tokens=False)
        if not c:
            return 0.0, 0
        ids = torch.tensor([p + c])
        logits = self.model.logits(self.model(ids)[:, len(p) - 1 : -1]).float()  # [1, C, V]
        logp = torch.log_softmax(logits, -1)[0, torch.arange(len(c)), torch.tensor(c)]
        return -float(logp.sum()), len(c)

    def entropy(self, text: str) -> float:
        counts = Counter(self.tok.encode(text, add_special_tokens=False))
        total = sum(counts.values())
        return -sum(n / total * math.log(n / total) for n in counts.values()) if total else 0.0

    def score(self, prompts: list[str], texts: list[str]) -> dict[str, float]:
        nll, count = 0.0, 0
        for prompt, text in zip(prompts, texts, strict=True):
            s, n = self.nll(prompt, text)
            nll, count = nll + s, count + n
        return {
            "gen_ppl": round(math.exp(nll / max(count, 1)), 2),
            "entropy": round(statistics.mean(self.entropy(t) for t in texts), 3),
        }


def run(args: Any) -> dict:
    dtype = getattr(torch, args.dtype)
    kernels.enable_cpu_kernels()
    torch.manual_seed(0)
    teacher = engine_for(resolve(args.teacher), dtype, args.batch)
    student = engine_for(resolve(args.student), dtype, args.batch)
    rows = [Row("vanilla", teacher, "vanilla"), Row("fast_dllm", teacher, "fast_dllm")]
    rows.append(Row("cdlm", student, "cdlm"))
    for spec in args.variant or []:
        name, _, folder = spec.partition("=")
        rows.append(Row(f"cdlm_{name}", engine_for(resolve(folder), dtype, args.batch), "cdlm"))
    prose = held_out_prose(args.text_limit)
    prompts = [p for p, _ in prose]
    runs, same_path = both_paths(rows, prompts, args)
    judge = Judge()
    result: dict[str, dict] = {}
    for row in rows:
        scores, task_steps = task_scores(row, args.limit, args)
        text = runs[row.name]
        result[row.name] = {
            **speed(text),
            "same_path": same_path[row.name],
            "score": round(statistics.mean(scores.values()), 2),
            "exact_match": scores,
            "task_steps": round(task_steps, 2),
            **judge.score(prompts, [r[3] for r in text]),
        }
    result["reference"] = judge.score(prompts, [c[: args.max_tokens] for _, c in prose])
    _print(result, args)
    return result


def _print(result: dict, args: Any) -> None:
    base = result["vanilla"]
    print(
        f"\ntask suites: first {args.limit} held-out problems each; text suite: "
        f"{args.text_limit} held-out prompts x {args.max_tokens} tokens, batch 1, {args.dtype}"
    )
    head = (
        f"{'row':<22}{'latency':>10}{'':>8}{'steps':>8}{'':>8}{'tok/s':>8}{'EM %':>7}"
        f"{'add3':>7}{'trace4':>7}{'t.steps':>8}{'gen_ppl':>9}{'entropy':>8}"
    )
    print(head)
    for name, r in result.items():
        if name == "reference":
            print(f"{'true continuation':<22}{'':>73}{r['gen_ppl']:>9.2f}{r['entropy']:>8.3f}")
            continue
        fast = f"({base['latency_s'] / r['latency_s']:.1f}x)" if name != "vanilla" else ""
        fewer = f"({base['steps'] / r['steps']:.1f}x)" if name != "vanilla" else ""
        em = r["exact_match"]
        print(
            f"{name:<22}{r['latency_s']:>8.2f} s{fast:>8}{r['steps']:>8.1f}{fewer:>8}"
            f"{r['tok_s']:>8.1f}{r['score']:>7.1f}{em['addition3']:>7.1f}{em['trace4']:>7.1f}"
            f"{r['task_steps']:>8.1f}{r['gen_ppl']:>9.2f}{r['entropy']:>8.3f}"
        )
    print_same_path({k: v["same_path"] for k, v in result.items() if k != "reference"}, args.dtype)


def _same_path_label(dtype: str) -> str:
    if not kernels.enable_cpu_kernels():
        return "no fused kernels here: both tables ran the same code"
    if dtype != "bfloat16":
        return "fused kernels are bf16-only: both tables ran the same code"
    return "fused CPU kernels off"


def print_same_path(rows: dict[str, dict], dtype: str) -> None:
    """The text suite again with every decoder on the same (PyTorch) path: the algorithms'
    difference without the kernels'."""
    print(f"\nsame path for every decoder ({_same_path_label(dtype)})")
    print(f"{'row':<22}{'latency':>10}{'':>8}{'steps':>8}{'tok/s':>8}")
    base = rows["vanilla"]
    for name, r in rows.items():
        fast = f"({base['latency_s'] / r['latency_s']:.1f}x)" if name != "vanilla" else ""
        print(f"{name:<22}{r['latency_s']:>8.2f} s{fast:>8}{r['steps']:>8.1f}{r['tok_s']:>8.1f}")
