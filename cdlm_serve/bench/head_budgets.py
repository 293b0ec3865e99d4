"""A measured budget schedule for a model: how much each KV head's slots matter to its answers.

    python -m cdlm_serve.bench.head_budgets [--contexts 4] [--ratio 10]
                                            [--out engine/compaction/budget_schedules/M.json]

The AM paper's non-uniform budgets, measured offline once per model (its influence curves):
on calibration contexts (Python standard-library docstrings with the compaction bench's
synthetic facts inserted: neither of the texts `bench.compaction` evaluates on), every context
is compacted uniformly to t slots per KV head with `--method`, and also to t/2, 2t, 4t and 8t
(LEVELS); then, one (layer, KV head) at a time, that head's segment is swapped for one of the
others, the rest left at t, and the facts' answer NLL measured (`bench.facts.answer_nll`'s,
all questions in one batch: `facts_nll`; the questions' wording, the paraphrased questions stay
held out). The change from the uniform cache, averaged over contexts, is each head's curve at
t/2, t, 2t, 4t and 8t: a convex piecewise-linear loss of its slots (the lower convex hull of
the measured points; a head whose loss does not fall with more slots gains nothing from them).

The schedule spends the same total, layers x heads x t, where the curves fall fastest: every
head from t/2, the slots to the steepest segments first. Its shares (a head's slots over the
total) are written to `--out`; `engine.compaction.budgets.from_schedule` applies them at any
ratio. A head's swapped segment is padded to 8t with masked slots (zero K/V, -inf bias, which
change no logits), so every head of a layer keeps one length while the others stay at t.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import random
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor

from cdlm_serve.bench.compaction import QUERY_SOURCE, save_json
from cdlm_serve.bench.facts import answer_loss, make_context
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.engine.compaction.budgets import SCHEDULE_MOST, schedule_name
from cdlm_serve.engine.compaction.queries import reference_queries
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

# Standard-library modules whose docstrings are the calibration text (~100K words on 3.11).
DOC_MODULES = (
    "argparse",
    "asyncio.base_events",
    "asyncio.streams",
    "collections",
    "configparser",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "email.utils",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "http.client",
    "http.cookiejar",
    "http.server",
    "imaplib",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "logging.handlers",
    "mailbox",
    "multiprocessing.pool",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pydoc",
    "random",
    "re",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tkinter",
    "turtle",
    "typing",
    "unittest.case",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
)

Segment = tuple[Tensor, Tensor, Tensor]  # keys, values [Hkv, t, D], biases [Hkv, t]
# The budgets each head's loss is measured at besides t, as multiples of t. Up to 8t: the
# heads that carry the fact lookups still lose steeply past 2t, and past 4t (SmolLM2-135M's
# layer 18 head 2, 3 contexts: +0.09 at t/2, -0.09 at 2t, -0.22 at 4t, -0.49 at 8t); with a
# 2t ceiling 23 of its 90 heads got the ceiling, with 4t five, with 8t three (and two 4t).
# The highest level is the most `from_schedule` lets a head have.
LEVELS = {"low": 0.5, "high": 2.0, "higher": 4.0, "highest": float(SCHEDULE_MOST)}


def calibration_text() -> str:
    """The docstrings of DOC_MODULES (module, classes, their methods, functions), in order."""
    import importlib

    docs: list[str] = []
    for name in DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without it (tkinter, sqlite3)
            continue
        for obj in [module, *(v for _, v in sorted(vars(module).items()))]:
            if inspect.getmodule(obj) is not module and obj is not module:
                continue
            members = [obj]
            if inspect.isclass(obj):
                members += [v for _, v in sorted(vars(obj).items()) if callable(v)]
            for m in members:
                doc = inspect.getdoc(m)
                if doc and len(doc) > 80:
                    docs.append(doc)
    return " ".join(docs).replace("\n", " ")


def segments(compacted: KVCache, slots: int) -> list[Segment]:
    """Per layer, the first `slots` slots of row 0 (a compacted segment), fp32 copies."""
    biases = compacted.biases
    assert biases is not None
    return [
        (
            compacted.keys[i][0, :, :slots].float().clone(),
            compacted.values[i][0, :, :slots].float().clone(),
            biases[i][0, :, :slots].float().clone(),
        )
        for i in range(compacted.num_layers)
    ]


def padded(seg: Segment, slots: int) -> Segment:
    """A segment padded to `slots` with masked slots (zero K/V, -inf bias)."""
    k, v, b = seg
    extra = slots - k.shape[1]
    pad = k.new_zeros(k.shape[0], extra, k.shape[2])
    hidden = torch.full((k.shape[0], extra), float("-inf"))
    return torch.cat([k, pad], 1), torch.cat([v, pad], 1), torch.cat([b, hidden], 1)


def swapped_cache(
    full: KVCache, region: int, base: list[Segment], slots: int, rows: int = 1
) -> KVCache:
    """Row 0 of `full` with its region replaced by `base` padded to `slots` per head, in
    `rows` identical rows (one per question `facts_nll` asks at once)."""
    work = full.extract_row(0)
    pads = [padded(s, slots) for s in base]
    dtype = full.keys[0].dtype
    work.replace_prefix(
        0,
        region,
        [p[0].to(dtype) for p in pads],
        [p[1].to(dtype) for p in pads],
        [p[2] for p in pads],
    )
    biases = work.biases
    assert biases is not None

    def repeat(t: Tensor) -> Tensor:  # [1, ...] -> [rows, ...], its own memory
        return t.expand(rows, *t.shape[1:]).clone()

    return KVCache(
        [repeat(k) for k in work.keys],
        [repeat(v) for v in work.values],
        work.lengths * rows,
        work.logical * rows,
        [repeat(b) for b in biases],
    )


def put_head(work: KVCache, layer: int, head: int, seg: Segment, slots: int) -> None:
    """Write one head's segment (padded to `slots`) into the first slots of `work`'s layer,
    in every row."""
    k, v, b = padded(seg, slots)
    biases = work.biases
    assert biases is not None
    work.keys[layer][:, head, :slots] = k[head].to(work.keys[layer].dtype)
    work.values[layer][:, head, :slots] = v[head].to(work.values[layer].dtype)
    biases[layer][:, head, :slots] = b[head].to(biases[layer].dtype)


def facts_nll(model, cache: KVCache, facts: list[tuple[list[int], list[int]]]) -> float:
    """The mean of `bench.facts.answer_nll` over the (question, answer) pairs, in one
    forward: row i of `cache` (as many rows as pairs, all alike) continues with pair i, the
    shorter pairs padded at their end, which no earlier position of a causal model sees."""
    assert cache.batch == len(facts)
    seqs = [q + a for q, a in facts]
    width = max(len(x) for x in seqs)
    ids = torch.tensor([x + [x[-1]] * (width - len(x)) for x in seqs], device=model.device)
    cache.ensure_capacity(cache.lengths[0] + width)
    hidden = model(ids, cache=cache, commit=False)  # [pairs, width, hidden]
    return statistics.mean(
        answer_loss(model, hidden[i], len(q), a) for i, (q, a) in enumerate(facts)
    )


def head_curves(model, tok, ids, facts, target: int, method: str, keep_recent: int) -> dict:
    """One context's influence: per (layer, head), the facts NLL change at each of LEVELS."""
    region = len(ids) - keep_recent
    full = model.new_cache(1, len(ids) + 64)
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device), cache=full)
    source = QUERY_SOURCE[method]  # the fidelity bench's source for the method
    queries = list(reference_queries(model, tok, full, 0, ids, source))
    levels = {"base": target} | {
        name: min(region, max(1, int(x * target))) for name, x in LEVELS.items()
    }
    segs = {}
    for name, t in levels.items():
        cache = full.extract_row(0)
        compact_row(
            model,
            cache,
            0,
            ids,
            CompactionSpec.exact(t, method=method, query_source=source, keep_recent=keep_recent),
            CompactionRuntime(tokenizer=tok, reference=queries),
        )
        segs[name] = segments(cache, t)
    slots = max(levels.values())
    work = swapped_cache(full, region, segs["base"], slots, rows=len(facts))
    base = facts_nll(model, work, facts)
    cfg = model.config
    delta = {name: [[0.0] * cfg.num_kv_heads for _ in range(cfg.num_layers)] for name in LEVELS}
    for layer in range(cfg.num_layers):
        for head in range(cfg.num_kv_heads):
            for name in LEVELS:
                put_head(work, layer, head, segs[name][layer], slots)
                delta[name][layer][head] = facts_nll(model, work, facts) - base
            put_head(work, layer, head, segs["base"][layer], slots)
    return {"base_nll": base, "levels": levels, **delta}


def solve(changes: list[list[float]], target: int) -> list[int]:
    """Slots per head (flat) spending heads x target, given each head's loss change from t at
    each of LEVELS (changes[h], in LEVELS' order): every head from the fewest, then the
    steepest falls first, a head's segments in order (its curve made convex: `_falls`)."""
    sizes = [max(1, int(x * target)) for x in LEVELS.values()]
    fewest = min(sizes)
    segments_: list[tuple[float, int, int, int]] = []  # (loss fall per slot, order, head, slots)
    for h, change in enumerate(changes):
        points = sorted([(target, 0.0), *zip(sizes, change, strict=True)])
        for order, (fall, size) in enumerate(_falls(points)):
            segments_.append((max(fall, 0.0), order, h, size))
    slots = [fewest] * len(changes)
    left = (target - fewest) * len(changes)
    for _, _, h, size in sorted(segments_, key=lambda s: (-s[0], s[1])):
        take = min(size, left)
        slots[h] += take
        left -= take
        if left == 0:
            break
    return slots


def shares_of(slots: list[int], heads: int) -> list[list[float]]:
    """Per layer, per KV head, its slots (flat, as `solve` gives them) over their total."""
    total = sum(slots)
    return [[x / total for x in slots[i : i + heads]] for i in range(0, len(slots), heads)]


def _falls(points: list[tuple[int, float]]) -> list[tuple[float, int]]:
    """(loss fall per slot, slots) of each segment between the (slots, loss) points, in order,
    merged where a later segment falls faster than an earlier one (pool adjacent violators:
    the lower convex hull), so that the falls never steepen with more slots."""
    out: list[tuple[float, int]] = []
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x1 <= x0:
            continue
        out.append(((y0 - y1) / (x1 - x0), x1 - x0))
        while len(out) > 1 and out[-1][0] > out[-2][0]:
            (f2, s2), (f1, s1) = out.pop(), out.pop()
            out.append(((f1 * s1 + f2 * s2) / (s1 + s2), s1 + s2))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--method", default="am-highest-fast")
    p.add_argument("--contexts", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--ratio", type=float, default=10)
    p.add_argument("--keep-recent", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, help="the schedule JSON: engine/compaction/budget_schedules/NAME.json"
    )
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=getattr(torch, args.dtype))
    text = calibration_text()
    rng = random.Random(args.seed)
    curves = []
    for c in range(args.contexts):
        started = time.perf_counter()
        context, facts, _ = make_context(text, tok, args.length, args.facts, rng)
        ids = tok(context, add_special_tokens=False).input_ids
        encode = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        qa = [(encode(f.question), encode(f.answer)) for f in facts]
        target = max(1, round(len(ids) / args.ratio) - args.keep_recent)
        curves.append(head_curves(model, tok, ids, qa, target, args.method, args.keep_recent))
        print(
            f"context {c}: {len(ids)} tokens, t {target}, facts NLL at t "
            f"{curves[-1]['base_nll']:.3f}, {time.perf_counter() - started:.0f}s",
            flush=True,
        )
    cfg = model.config
    mean = {
        name: [
            statistics.mean(cv[name][layer][head] for cv in curves)
            for layer in range(cfg.num_layers)
            for head in range(cfg.num_kv_heads)
        ]
        for name in LEVELS
    }
    t = curves[0]["levels"]["base"]
    flat = solve([list(x) for x in zip(*(mean[n] for n in LEVELS), strict=True)], t)
    heads = cfg.num_kv_heads
    shares = shares_of(flat, heads)
    at = " | ".join(f"{x:g}t" for x in LEVELS.values())
    print(f"\nper layer: slots (of {heads} x {t} uniform), facts NLL change at {at}")
    for layer in range(cfg.num_layers):
        row = slice(layer * heads, (layer + 1) * heads)
        changes = (" ".join(f"{x:+.3f}" for x in mean[name][row]) for name in LEVELS)
        print(f"  layer {layer:>2}: {sum(flat[row]):>5}  " + " | ".join(changes))
    result = {
        "model": schedule_name(args.model),
        "method": args.method,
        "ratio": args.ratio,
        "calibration": {
            "text": "Python standard-library docstrings (bench/head_budgets.py DOC_MODULES)",
            "contexts": args.contexts,
            "tokens": args.length,
            "facts": args.facts,
            "seed": args.seed,
            "dtype": args.dtype,
        },
        "delta_nll": mean,
        "slots_at_ratio": flat,
        "shares": shares,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
