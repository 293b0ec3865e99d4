"""A measured budget schedule for a model: how much each KV head's slots matter to its answers.

    python -m bench.head_budgets [--contexts 4] [--ratio 10] [--out engine/budget_schedules/M.json]

The AM paper's non-uniform budgets, measured offline once per model (its influence curves):
on calibration contexts (Python standard-library docstrings with the compaction bench's
synthetic facts inserted: neither of the texts `bench.compaction` evaluates on), every context
is compacted uniformly to t slots per KV head with `--method`, and also to t/2 and to 2t; then,
one (layer, KV head) at a time, that head's segment is swapped for its t/2 or 2t one, the rest
left at t, and the facts' answer NLL measured (`bench.compaction.answer_nll`, the questions'
wording; the paraphrased questions stay held out). The change from the uniform cache, averaged
over contexts, is each head's curve at t/2, t and 2t: a convex piecewise-linear loss of its
slots (the upper hull where the measured points are not convex; a head whose loss does not fall
with more slots gains nothing from them).

The schedule spends the same total, layers x heads x t, where the curves fall fastest: every
head from t/2, the slots to the steepest segments first. Its shares (a head's slots over the
total) are written to `--out`; `engine.compaction_budgets.from_schedule` applies them at any
ratio. A head's swapped segment is padded to 2t with masked slots (zero K/V, -inf bias, which
change no logits), so every head of a layer keeps one length while the others stay at t.
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor

from bench.compaction import QUERY_SOURCE, answer_nll, make_context, save_json
from engine.compaction_budgets import schedule_name
from engine.kv_compaction import compact_row, reference_queries
from models.kv_cache import KVCache
from models.loading import load_model
from models.sources import DEFAULT_AR_MODEL, resolve

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


def swapped_cache(full: KVCache, region: int, base: list[Segment], slots: int) -> KVCache:
    """Row 0 of `full` with its region replaced by `base` padded to `slots` per head."""
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
    return work


def put_head(work: KVCache, layer: int, head: int, seg: Segment, slots: int) -> None:
    """Write one head's segment (padded to `slots`) into the first slots of `work`'s layer."""
    k, v, b = padded(seg, slots)
    biases = work.biases
    assert biases is not None
    work.keys[layer][0, head, :slots] = k[head].to(work.keys[layer].dtype)
    work.values[layer][0, head, :slots] = v[head].to(work.values[layer].dtype)
    biases[layer][0, head, :slots] = b[head].to(biases[layer].dtype)


def facts_nll(model, cache: KVCache, facts: list[tuple[list[int], list[int]]]) -> float:
    return statistics.mean(answer_nll(model, cache, q, a) for q, a in facts)


def head_curves(model, tok, ids, facts, target: int, method: str, keep_recent: int) -> dict:
    """One context's influence: per (layer, head), the facts NLL change at t/2 and 2t."""
    region = len(ids) - keep_recent
    full = model.new_cache(1, len(ids) + 64)
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device), cache=full)
    source = QUERY_SOURCE[method]  # the fidelity bench's source for the method
    queries = list(reference_queries(model, tok, full, 0, ids, source))
    levels = {"low": max(1, target // 2), "base": target, "high": min(region, 2 * target)}
    segs = {}
    for name, t in levels.items():
        cache = full.extract_row(0)
        compact_row(model, tok, cache, 0, ids, t, method, source, keep_recent, reference=queries)
        segs[name] = segments(cache, t)
    slots = levels["high"]
    work = swapped_cache(full, region, segs["base"], slots)
    base = facts_nll(model, work, facts)
    cfg = model.config
    delta = {"low": [[0.0] * cfg.num_kv_heads for _ in range(cfg.num_layers)]}
    delta["high"] = [[0.0] * cfg.num_kv_heads for _ in range(cfg.num_layers)]
    for layer in range(cfg.num_layers):
        for head in range(cfg.num_kv_heads):
            for name in ("low", "high"):
                put_head(work, layer, head, segs[name][layer], slots)
                delta[name][layer][head] = facts_nll(model, work, facts) - base
            put_head(work, layer, head, segs["base"][layer], slots)
    return {"base_nll": base, "levels": levels, **delta}


def solve(low: list[float], high: list[float], target: int) -> list[int]:
    """Slots per head (flat) spending heads x target, given each head's loss change at t/2
    (`low`) and 2t (`high`) from t: every head from t/2, then the steepest falls first."""
    half, double = max(1, target // 2), 2 * target
    segments_: list[tuple[float, int, int]] = []  # (loss fall per slot, head, slots)
    for h, (dl, dh) in enumerate(zip(low, high, strict=True)):
        first = dl / (target - half) if target > half else 0.0  # t/2 -> t
        second = -dh / (double - target)  # t -> 2t
        if second > first:  # not convex: the chord over both
            first = second = (dl - dh) / (double - half)
        segments_ += [(max(first, 0.0), h, target - half), (max(second, 0.0), h, target)]
    slots = [half] * len(low)
    left = target * len(low) - half * len(low)
    # Steepest first; within a head the t/2 -> t segment always comes before t -> 2t.
    for _, h, size in sorted(segments_, key=lambda s: -s[0]):
        take = min(size, left)
        slots[h] += take
        left -= take
        if left == 0:
            break
    return slots


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
    p.add_argument("--out", type=Path, help="the schedule JSON: engine/budget_schedules/NAME.json")
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
        for name in ("low", "high")
    }
    t = curves[0]["levels"]["base"]
    flat = solve(mean["low"], mean["high"], t)
    total = sum(flat)
    heads = cfg.num_kv_heads
    shares = [[flat[i + j] / total for j in range(heads)] for i in range(0, len(flat), heads)]
    print(f"\nper layer: slots (of {heads} x {t} uniform), facts NLL change at t/2 | 2t")
    for layer in range(cfg.num_layers):
        row = slice(layer * heads, (layer + 1) * heads)
        print(
            f"  layer {layer:>2}: {sum(flat[row]):>5}  "
            + " ".join(f"{x:+.3f}" for x in mean["low"][row])
            + " | "
            + " ".join(f"{x:+.3f}" for x in mean["high"][row])
        )
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
