"""Online compaction, measured: a session fed a long text in chunks, compacting itself by its
policy (`engine.compaction.auto.AutoCompact`, the server's own rule), against the full cache
and against StreamingLLM held to the same size.

    python -m cdlm_serve.bench.online_compaction [--tokens 8000] [--chunk 256] [--max-tokens 768]
                                                 [--ratio 4] [--keep-recent 128] [--contexts 3]
                                                 [--curve-every N] [--json out.json]

The text is Jane Austen (or `--text`, as bench.compaction takes it) of `--tokens` tokens with
`--facts` synthetic facts spread through it. Each run starts from an empty cache and appends
the text `--chunk` tokens at a time; after each append, a policy run compacts as the policy
says (whenever the cache is past `--max-tokens` physical slots: the part before the last
`--keep-recent` slots, `--ratio`x, with the run's method, `+int8` for int8 codes, `+attn` or
`+measured` for its budgets as in bench.compaction), so early
facts go through many compactions. Then every run answers the facts' questions (and their
paraphrases) from its final cache: the fraction of the full cache's benefit kept, as in
bench.compaction, the physical size it ended at and the largest it reached, its bytes, and
how many compactions it took and how long (all, and the longest one); medians over
`--contexts` contexts. Also per run: the facts kept in each quarter of the context, earliest
first (where a run's facts come from), and with `--curve-every N` the curve of facts kept
against tokens read, measured every N tokens on the facts read by then against the full cache
at the same point (`--tokens 32000 --chunk 1024 --facts 80 --curve-every 2048`: 32K tokens,
a compaction after each 1K appended). A text longer than the model's context
(`max_position_embeddings`) is fed to the full cache only up to that less 512 (room for the
questions): past it the curve has each run's facts NLL without a share kept, and the
summary's shares are against that shorter full cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from cdlm_serve.bench.compaction import (
    budget_schedule,
    long_text,
    method_spec,
    resident_bytes,
    save_json,
)
from cdlm_serve.bench.facts import Probe, fact_nlls, kept, make_context, measure
from cdlm_serve.engine.compaction import (
    CompactionReport,
    CompactionRuntime,
    compact_row,
)
from cdlm_serve.engine.compaction.auto import AutoCompact
from cdlm_serve.models import kernels
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve


class Watch(Protocol):
    """What a caller of `feed` may follow (bench.compaction_ceiling tracks which token each
    slot holds): each append with its hidden states, and each compaction's start and end."""

    def appended(self, start: int, hidden: Tensor) -> None: ...  # hidden [n, hidden]

    def compacting(self) -> None: ...

    def compacted(self) -> None: ...


def feed(
    model,
    tok,
    ids: list[int],
    args,
    method: str | None,
    checkpoint: Callable[[int, KVCache], None] | None = None,
    watch: Watch | None = None,
) -> dict:
    """Append `ids` chunk by chunk, compacting by the policy after each (no compaction for
    method None). Returns the final cache and what happened on the way. `checkpoint(fed,
    cache)` is called after each append (and its compaction) that crosses a multiple of
    `args.curve_every` tokens, and after the last; `watch` is told of every append and
    compaction."""
    every = getattr(args, "curve_every", 0) or len(ids)
    policy, schedule = None, None
    if method is not None:
        # METHOD[+int8][+attn|+measured], as bench.compaction's flags; the policy's own query
        # source and key queries (None), as a session created with it would compact.
        spec = method_spec(method)
        policy = AutoCompact.of(
            args.max_tokens,
            args.ratio,
            spec.name,
            keep_recent=args.keep_recent,
            quantize=spec.quantize,
            budgets=spec.budgets,
        )
        schedule = budget_schedule(model, args) if spec.budgets == "measured" else None
    cache = model.new_cache(1, args.max_tokens + 2 * args.chunk)
    largest, seconds, reports = 0, 0.0, []
    with torch.no_grad():
        for start in range(0, len(ids), args.chunk):
            chunk = ids[start : start + args.chunk]
            cache.ensure_capacity(cache.lengths[0] + len(chunk))
            hidden = model(torch.tensor([chunk], device=model.device), cache=cache)
            if watch is not None:
                watch.appended(start, hidden[0])
            largest = max(largest, cache.lengths[0])
            fed = start + len(chunk)
            physical = cache.lengths[0]
            target = policy.target(physical) if policy and policy.due(physical) else None
            if policy is not None and target is not None:
                last = reports[-1].segment_slots if reports else None
                if watch is not None:
                    watch.compacting()
                reports.append(
                    _compact(model, tok, cache, ids[:fed], target, policy, schedule, last)
                )
                if watch is not None:
                    watch.compacted()
                seconds += reports[-1].seconds["total"]
            if checkpoint is not None and (fed // every > start // every or fed == len(ids)):
                checkpoint(fed, cache)
    return {
        "cache": cache,
        "largest": largest,
        "compactions": len(reports),
        "seconds": seconds,
        "bytes": resident_bytes(cache, reports[-1]) if reports else cache.nbytes(0),
        "longest_s": max((r.seconds["total"] for r in reports), default=0.0),
    }


def _compact(
    model,
    tok,
    cache: KVCache,
    history: list[int],
    target: int,
    policy: AutoCompact,
    schedule: list[list[float]] | None,
    segment: int | None,
) -> CompactionReport:
    """Row 0 compacted to `target` as the policy says (what the server's auto-compaction
    runs); `segment`: the last compaction's segment_slots."""
    return compact_row(
        model,
        cache,
        0,
        history,
        policy.spec,  # its target(physical) is `target`
        CompactionRuntime(
            tokenizer=tok, schedule=schedule, segment_slots=segment, longest=policy.longest(target)
        ),
    )


def feed_arguments(p: argparse.ArgumentParser) -> None:
    """The contexts, the feed and its policy: this bench's flags, and bench.compaction_ceiling's."""
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--text", help="as bench.compaction's --text")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--facts", type=int, default=40)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=768)  # + a chunk: at most 1,024 slots
    p.add_argument("--ratio", type=float, default=4)
    p.add_argument("--keep-recent", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    # One context's run is noisy: the same policy with repeat-banded vs repeat queries in its
    # first compaction alone (output errors 0.171 both) ended 0.56 vs -0.12 facts kept on a
    # 4K context. Medians over several contexts (seeds seed, seed + 1, ...) say more.
    p.add_argument("--contexts", type=int, default=3)
    p.add_argument("--json", type=Path)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    feed_arguments(p)
    p.add_argument(
        "--methods",
        nargs="+",
        default=[
            "am-h2o",
            "am-highest-fast",
            "am-highest-fast+int8",
            "am-omp-fast",
            "streaming",
            "h2o",
        ],
    )
    # The curve of facts kept against tokens read: every run measured each N tokens on the
    # facts read by then (0: at the end only). `--tokens 32000 --chunk 1024 --facts 80
    # --curve-every 2048` is the 32K curve (a compaction after every 1K appended).
    p.add_argument("--curve-every", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=getattr(torch, args.dtype))
    if args.dtype == "bfloat16":  # the fused CPU kernels, as the server runs bf16
        kernels.enable_cpu_kernels()
    text = long_text(args.text)
    rows: list[dict] = []
    for c in range(args.contexts):
        rows += _context_runs(model, tok, text, random.Random(args.seed + c), c, args)
        if args.json:
            save_json(args.json, {"args": vars(args) | {"json": str(args.json)}, "rows": rows})
    _print(rows, args)
    return rows


# A fact's statement in a context's ids: its first token, its answer's first, its end.
Span = tuple[int, int, int]
# A run of one method on a context's ids: (ids, method, checkpoint, the facts' spans) -> what
# `feed` returns.
Feeder = Callable[[list[int], str, Callable[[int, KVCache], None] | None, list[Span]], dict]


def _context_runs(
    model, tok, text: str, rng: random.Random, c: int, args, feeder: Feeder | None = None
) -> list[dict]:
    """One context (its own facts and place in the text): the full cache's run, then each
    method's (by `feed`, or `feeder`), each row tagged with the context's index."""
    # The context is cut a little short of --tokens: the questions must fit the model too.
    context, facts, continuation = make_context(text, tok, args.tokens, args.facts, rng)
    ids = tok(context, add_special_tokens=False).input_ids

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    probe = Probe(
        facts=[(encode(f.question), encode(f.answer)) for f in facts],
        paraphrases=[(encode(f.paraphrase), encode(f.answer)) for f in facts],
        continuation=continuation,
        recon_prompt=encode("\n\n") + ids[:1],
        recon_target=ids[1:65],
    )
    spans = []  # each fact's statement in ids: its first token, its answer's, its end
    for f in facts:
        at = context.index(f.statement[:-1])
        end = len(encode(context[: at + len(f.statement) - 1]))  # without the final period
        spans.append((len(encode(context[:at])), end - len(encode(f.answer)) + 1, end))
    ends = [end for _, _, end in spans]  # the tokens fed once each fact has been read
    none_each = fact_nlls(model, None, probe)
    none = measure(model, None, probe, em=False, facts=list(none_each.values()))
    started = time.perf_counter()
    full_curve = _Curve(model, probe, ends)
    # The full cache is the reference within the model's context only: past it the model
    # reads positions it was never trained on (a compacted session keeps its logical
    # positions too), and its O(T^2) feed is most of a 32K run.
    window = model.config.max_position_embeddings
    reach = len(ids) if len(ids) <= window else window - 512
    full = feed(model, tok, ids[:reach], args, None, full_curve.at if args.curve_every else None)
    fed = time.perf_counter() - started
    print(
        f"context {c}: {len(ids)} tokens, {len(facts)} facts; the full cache "
        f"({reach} tokens) fed in {fed:.0f} s"
    )
    full_each = fact_nlls(model, full["cache"], probe)
    base = measure(model, full["cache"], probe, em=False, facts=list(full_each.values()))
    rows = [_row("full cache", full, base, none, base) | {"context": c}]
    for method in args.methods:
        curve = _Curve(model, probe, ends)
        checkpoint = curve.at if args.curve_every else None
        if feeder is None:
            run = feed(model, tok, ids, args, method, checkpoint)
        else:
            run = feeder(ids, method, checkpoint, spans)
        got_each = fact_nlls(model, run["cache"], probe)
        got = measure(model, run["cache"], probe, em=False, facts=list(got_each.values()))
        rows.append(
            _row(method, run, got, none, base)
            | {
                "context": c,
                "by_depth": _by_depth(none_each, full_each, got_each),
                "curve": curve.kept(none_each, full_curve),
            }
        )
        print(_line(method, rows[-1:]), flush=True)
    return rows


def _by_depth(none: dict[int, float], full: dict[int, float], got: dict[int, float]) -> list:
    """The facts kept (`kept` of the means, as the headline) in each quarter of the context,
    earliest first: where what a run keeps comes from. A run that holds only the recent
    tokens still gains on old facts, since the answer's form (a code word from the same
    list, a dash, three digits) is learnt from any fact it holds."""
    n = len(none)
    quarters = [range(q * n // 4, (q + 1) * n // 4) for q in range(4)]

    def mean(d: dict[int, float], idx: range) -> float:
        return statistics.mean(d[i] for i in idx)

    return [round(kept(mean(none, q), mean(full, q), mean(got, q)), 3) for q in quarters]


@dataclass(eq=False)
class _Curve:
    """A run's facts NLLs at its checkpoints: those of the facts read by then."""

    model: Any
    probe: Probe
    ends: list[int]  # tokens fed once each fact has been read
    points: dict[int, dict[int, float]] = field(default_factory=dict)

    def at(self, fed: int, cache: KVCache) -> None:
        seen = [i for i, end in enumerate(self.ends) if end <= fed]
        self.points[fed] = fact_nlls(self.model, cache, self.probe, which=seen)

    def kept(self, none: dict[int, float], full: _Curve) -> list[dict]:
        """Per checkpoint: tokens fed, facts read, this run's facts NLL, the full cache's
        there, and the share of the full cache's benefit this run keeps."""
        out = []
        for fed, got in self.points.items():
            if not got:
                continue
            seen = list(got)
            nll = statistics.mean(got.values())
            point = {"tokens": fed, "facts": len(seen), "nll": round(nll, 4)}
            point |= {"none_nll": round(statistics.mean(none[i] for i in seen), 4)}
            if fed in full.points:  # within the full cache's reach
                reference = statistics.mean(full.points[fed][i] for i in seen)
                point["full_nll"] = round(reference, 4)
                point["kept"] = round(kept(point["none_nll"], reference, nll), 3)
            out.append(point)
        return out


def _row(name: str, run: dict, got: dict, none: dict, full: dict) -> dict:
    cache = run["cache"]
    return {
        "run": name,
        "logical": cache.logical[0],
        "physical": cache.lengths[0],
        "largest": run["largest"],
        "bytes": run["bytes"],
        "compactions": run["compactions"],
        "compaction_s": round(run["seconds"], 1),
        "facts_kept": kept(none["facts"], full["facts"], got["facts"]),
        "para_kept": kept(none["para"], full["para"], got["para"]),
        "cont_kept": kept(none["cont"], full["cont"], got["cont"]),
        "facts_nll": got["facts"],
        "longest_s": round(run["longest_s"], 1),
    }


def _print(rows: list[dict], args) -> None:
    print(
        f"\nonline compaction: chunks of {args.chunk}, past {args.max_tokens} physical slots "
        f"compact all but the last {args.keep_recent} {args.ratio:g}x ({args.dtype}), "
        f"{args.contexts} context(s), medians [min, max] over them"
    )
    print(
        f"{'run':<22}{'logical':>8}{'physical':>9}{'largest':>9}{'MB':>9}{'comp.':>6}"
        f"{'comp. s':>8}{'facts':>18}{'para':>18}{'cont':>18}"
    )
    names = list(dict.fromkeys(r["run"] for r in rows))
    for name in names:
        print(_line(name, [r for r in rows if r["run"] == name]))
    methods = [n for n in names if n != "full cache"]
    print("\nfacts kept by where they stand in the context (quarters, earliest first), medians")
    for name in methods:
        quarters = zip(*(r["by_depth"] for r in rows if r["run"] == name), strict=True)
        print(f"{name:<22}" + "".join(f"{statistics.median(q):8.2f}" for q in quarters))
    if args.curve_every:
        _print_curve(rows, methods)


def _print_curve(rows: list[dict], methods: list[str]) -> None:
    """Facts kept against tokens read: medians over contexts at each checkpoint, with the
    facts' mean answer NLL (the full cache's, and each run's) beside it."""
    print("\nfacts kept (of those read so far) against tokens read, medians over contexts;")
    print("in brackets the facts' answer NLL; past the full cache's reach (the model's")
    print("context) only the NLL, against none's (no context) and each other's")
    head = "".join(f"{m[:20]:>22}" for m in methods)
    print(f"{'tokens':>8}{'facts':>7}{'none NLL':>10}{'full NLL':>10}{head}")
    points: dict[int, dict[str, list[dict]]] = {}
    for r in rows:
        for p in r.get("curve", []):
            points.setdefault(p["tokens"], {}).setdefault(r["run"], []).append(p)
    for tokens, runs in sorted(points.items()):
        some = next(iter(runs.values()))
        facts = statistics.median(p["facts"] for p in some)
        none = statistics.median(p["none_nll"] for p in some)
        within = all("kept" in p for p in some)
        full = f"{statistics.median(p['full_nll'] for p in some):>10.2f}" if within else "-"
        cells = []
        for m in methods:
            got = runs.get(m, [])
            if not got:
                cells.append(f"{'-':>22}")
                continue
            nll = statistics.median(p["nll"] for p in got)
            share = f"{statistics.median(p['kept'] for p in got):.2f}" if within else "-"
            cells.append(f"{share:>14} ({nll:5.2f})")
        print(f"{tokens:>8}{facts:>7.0f}{none:>10.2f}{full:>10}" + "".join(cells))


def _line(name: str, runs: list[dict]) -> str:
    """A run's medians over its contexts' rows (one row: that row), with the [min, max] of
    what it kept where there are several."""

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def spread(key: str) -> str:
        values = [r[key] for r in runs]
        tail = f" [{min(values):5.2f},{max(values):5.2f}]" if len(runs) > 1 else ""
        return f"{median(key):6.2f}{tail}"

    return (
        f"{name:<22}{median('logical'):>8.0f}{median('physical'):>9.0f}"
        f"{median('largest'):>9.0f}{median('bytes') / 1e6:>9.1f}{median('compactions'):>6.0f}"
        f"{median('compaction_s'):>8.1f}{spread('facts_kept'):>18}{spread('para_kept'):>18}"
        f"{spread('cont_kept'):>18}"
    )


if __name__ == "__main__":
    main()
