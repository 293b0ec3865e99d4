"""KV compaction, side by side: Attention Matching vs token-selection baselines on SmolLM2.

    python -m cdlm_serve.bench.compaction [--contexts 5] [--ratios 5 10 20 50] [--json out.json]
    python -m cdlm_serve.bench.compaction --timing [--timing-lengths 1024 2048 4096 8192]
                                          [--timing-runs 3]
    python -m cdlm_serve.bench.compaction --layer-loss [--methods am-omp] [--ratios 10]
                                          [--json out.json]
    python -m cdlm_serve.bench.compaction --peer kvpress [--peer-presses snapkv kvzip ...]
        (kvpress's presses beside ours, rows `kvpress:<press>`; needs
         pip install -e '.[kvpress]' && pip install --no-deps kvpress==0.5.5)

Each context is a window of Jane Austen (2K-6K tokens; `--text FILE` or `--text python-reference`
for another text) with
>= 20 synthetic facts inserted at spread depths ("The code name of the blue box is
Orchid-417."): the far-dependence probe. The context is prefilled once; every method compacts a
copy of that cache to the same physical size t = T / ratio (a recent window of `--keep-recent`
tokens stays exact for every method), then is measured by the fraction of the context's benefit
it keeps, (nll_none - nll_method) / (nll_none - nll_full), on:

- facts (the headline): NLL of each fact's answer after its question;
- continuation (sanity): NLL of the true next 256 tokens;
- paraphrase: NLL of each fact's answer after the same question in other words;
- reconstruction: NLL of the context's first `--recon-tokens` tokens re-generated after an
  instruction to repeat it (what KVzip measures), worded unlike the repeat instruction the
  reference queries come from;

plus greedy exact match on the facts, the mean relative attention-output error, the bytes the
compacted cache takes, and compaction wall time by stage (without the reference queries'
capture: each source's queries are captured once per context and shared by every method and
ratio; `--timing` measures the whole cost). Methods (`engine.compaction.attention_matching.METHODS`
with their query sources): am-omp and am-highest use repeat + self-study queries, their -fast
variants banded repeat queries (`repeat-banded`), and am-highest ranks its keys by the context's
own queries (`key_queries`: +ctxkeys / +refkeys to choose); KVzip-style uses repeat queries;
SnapKV, H2O and Expected Attention score keys with the context's own queries; streaming and
random use none.

`--peer kvpress` adds NVIDIA's kvpress presses as rows `kvpress:<press>` (bench/kvpress_peer.py):
the same context prefilled by transformers and compressed by the press as kvpress ships it, to
the same physical size round(T / ratio) per KV head, the whole context (kvpress keeps no exact
recent window unless the press does, as SnapKV's and StreamingLLM's do), then measured by our
model on the same questions. Their compaction seconds exclude transformers' own prefill.

`--layer-loss` asks where a method's loss comes from: the context compacted by the first of
`--methods`, then measured with only one layer compacted (the others exact; the compacted layer's
segment padded to the region's length with masked slots, so every layer keeps its own length),
layer by layer, beside all layers at once. A loss spread thin over every layer that adds up
(single-layer losses summing to the whole) says the fit of each layer is the limit, not one
layer that breaks.

`--timing` measures instead how long each Attention Matching variant takes to compact one
context of each of `--timing-lengths` tokens (the start of Austen's first novel, 10x), split by
stage (queries, keys, beta, values), every variant on the same prefilled cache, one after
another, with nothing else running: the speed curve. With `--timing-runs N` each figure is the
median of N runs (the variants take turns within a run).

(~520 lines: one benchmark's grid of methods x ratios x flags and its three modes; the facts probe
it shares with bench/online_compaction.py and bench/head_budgets.py is bench/facts.py.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cdlm_serve.bench import kvpress_peer
from cdlm_serve.bench.facts import (
    RECON_INSTRUCTION,
    Probe,
    kept,
    make_context,
    measure,
    sequence_start,
)
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.engine.compaction.budgets import load_schedule
from cdlm_serve.engine.compaction.options import (
    AUTO,
    AUTO_METHOD,
    default_key_queries,
    default_query_source,
    resolve_auto,
)
from cdlm_serve.engine.compaction.queries import reference_queries
from cdlm_serve.engine.sessions.packed_cache import PackedCache
from cdlm_serve.models import kernels
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve

QUERY_SOURCE = {
    "am-omp": "repeat+self-study",
    "am-omp-fast": "repeat-banded",
    "am-highest": "repeat+self-study",
    "am-highest-fast": "repeat-banded",
    "am-h2o": "repeat-banded",
    "kvzip": "repeat",
    "snapkv": "context",
    "h2o": "context",
    "expected_attention": "context",
    "streaming": "context",
    "random": "context",
}
AM_METHODS = ("am-highest-fast", "am-highest", "am-omp-fast", "am-omp", "am-h2o")
STAGES = ("queries", "keys", "beta", "values", "total")


CPU = torch.device("cpu")  # the bench runs here
FLAGS = ("int8", "attn", "measured", "global", "ctxkeys", "refkeys")
BUDGET_FLAGS = {"attn": "attention", "measured": "measured", "global": "global"}


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    source: str
    quantize: str | None
    budgets: str
    keys: str  # key_queries: whose attention ranks the keys ("context" or "reference")


def method_spec(method: str) -> Spec:
    """METHOD[:SOURCE][+int8][+attn|+measured|+global][+ctxkeys|+refkeys] -> its settings; a source
    may hold a "+" itself (repeat+self-study). `auto` is the server's default (KVzip, global
    budgets, its query source on a CPU). ctxkeys / refkeys: the keys ranked by the
    context's own queries / the reference ones (by default the method's own,
    `engine.compaction.row.default_key_queries`)."""
    flags: set[str] = set()
    while (tail := method.rpartition("+")[2]) in FLAGS:
        flags.add(tail)
        method = method[: -len(tail) - 1]
    name, _, source = method.partition(":")
    if name == AUTO:  # the server's default, resolved as a request on this CPU bench is
        source = source or default_query_source(AUTO_METHOD, CPU)
    asked = next((BUDGET_FLAGS[f] for f in BUDGET_FLAGS if f in flags), None)
    name, budgets = resolve_auto(name, asked, source or None)
    quantize = "int8" if "int8" in flags else None
    keys = (
        "context"
        if "ctxkeys" in flags
        else "reference"
        if "refkeys" in flags
        else default_key_queries(name)
    )
    return Spec(name, source or QUERY_SOURCE[name], quantize, budgets, keys)


def compact_method(model, tok, cache, ids, target, method, args, captured=None):
    """compact_row with the bench's settings; `captured`: queries per source, shared."""
    spec = method_spec(method)
    return compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(
            target,
            method=spec.name,
            query_source=spec.source,
            keep_recent=args.keep_recent,
            quantize=spec.quantize,
            budgets=spec.budgets,
            key_queries=spec.keys,
        ),
        CompactionRuntime(
            tokenizer=tok,
            seed=args.seed,
            reference=(captured or {}).get(spec.source),
            schedule=budget_schedule(model, args) if spec.budgets == "measured" else None,
        ),
    )


def capture_references(model, tok, full, ids, methods) -> dict[str, list]:
    """The reference queries of every source our `methods` read, captured once from row 0 of
    `full`: every method and ratio of a context reads the same ones (on-policy ones depend on
    the fit and are captured each time; the context queries that rank keys, a sample re-read
    from the row, each compaction reads itself: `engine.compaction.row.context_key_queries`)."""
    sources = {method_spec(m).source for m in methods if not kvpress_peer.is_peer(m)}
    return {
        src: list(reference_queries(model, tok, full, 0, ids, src))
        for src in sorted(sources - {"on-policy"})
    }


def compact_copy(model, tok, hf, full, ids, slots, method, args, captured, hf_prefill_s):
    """A copy of row 0 of `full` compacted by `method` to `slots` physical slots, and its
    report: ours keep the last `args.keep_recent` of them exact; a kvpress press (`hf`, the
    transformers model) compresses the whole context to the same size (module doc)."""
    if kvpress_peer.is_peer(method):
        return kvpress_peer.compact(hf, full, ids, slots, method, hf_prefill_s)
    cache = full.extract_row(0)
    target = slots - args.keep_recent
    return cache, compact_method(model, tok, cache, ids, target, method, args, captured)


def budget_schedule(model, args) -> list[list[float]]:
    """The model's measured budget schedule (engine/compaction/budget_schedules/), which must
    exist."""
    schedule = load_schedule(args.model, model.config)
    if schedule is None:
        raise SystemExit(
            f"no budget schedule for {args.model}: run python -m cdlm_serve.bench.head_budgets"
        )
    return schedule


def resident_bytes(cache, report) -> int:
    """What the compacted row takes in a session store's memory between requests: packed
    (`PackedCache`: no padding of non-uniform budgets, int8 codes where quantized) where that
    is smaller, as the store keeps it, else its dense slots."""
    if not PackedCache.saves_memory(cache, report.codes):
        return cache.nbytes(0)
    return PackedCache.pack(cache, report.codes).nbytes()


def stored_bytes(cache, report) -> int:
    """What the compacted row takes on disk as a session (ragged where its heads' budgets
    differ, int8 codes where quantized): written out and measured."""
    import tempfile

    from cdlm_serve.engine.sessions import files as session_files

    with tempfile.TemporaryDirectory() as tmp:
        version = session_files.Version("row", "bench", [], None, [], 0.0, 0, 0, 0, [])
        folder = Path(tmp) / "row"
        return session_files.write_version(folder, version, cache, 0, report.codes).disk_bytes


def mixed_cache(full: KVCache, compacted: KVCache, layers: set[int], region: int) -> KVCache:
    """Row 0 of `full` with the first `region` slots of `layers` replaced by `compacted`'s
    segment (t slots, then the same recent tail), padded back to `region` slots with masked
    ones (zero K/V, -inf bias) so every layer keeps `full`'s length; the other layers exact."""
    out = full.extract_row(0)
    t = compacted.lengths[0] - (full.lengths[0] - region)
    keys, values, biases = [], [], []
    for layer in range(full.num_layers):
        k = full.keys[layer][0, :, :region]  # [Hkv, region, D]
        v = full.values[layer][0, :, :region]
        b = torch.zeros(k.shape[:2], device=k.device)  # [Hkv, region]
        if layer in layers:
            k, v, b = torch.zeros_like(k), torch.zeros_like(v), torch.full_like(b, -torch.inf)
            k[:, :t] = compacted.keys[layer][0, :, :t]
            v[:, :t] = compacted.values[layer][0, :, :t]
            b[:, :t] = 0 if compacted.biases is None else compacted.biases[layer][0, :, :t]
        keys.append(k)
        values.append(v)
        biases.append(b)
    out.replace_prefix(0, region, keys, values, biases)
    return out


def run_layer_loss(model, tok, full, ids, probe, base, captured, args, context) -> list[dict]:
    """Facts kept with each layer compacted alone, and with all of them (see the module doc)."""
    method = args.methods[0]
    region = len(ids) - args.keep_recent
    rows = []
    for ratio in args.ratios:
        target = max(1, round(len(ids) / ratio) - args.keep_recent)
        compacted = full.extract_row(0)
        compact_method(model, tok, compacted, ids, target, method, args, captured)
        layers: list[int | str] = ["all", *range(full.num_layers)]
        for layer in layers:
            chosen = set(range(full.num_layers)) if layer == "all" else {layer}
            got = measure(model, mixed_cache(full, compacted, chosen, region), probe, em=False)
            row = {
                "context": context,
                "tokens": len(ids),
                "method": method,
                "ratio": ratio,
                "layer": layer,
                "facts_kept": kept(base[0]["facts"], base[1]["facts"], got["facts"]),
                "para_kept": kept(base[0]["para"], base[1]["para"], got["para"]),
            }
            rows.append(row)
            print(
                f"  {ratio:>4.0f}x {method} layer {layer!s:>3}: facts {row['facts_kept']:+.3f} "
                f"para {row['para_kept']:+.3f}",
                flush=True,
            )
        lost = {r["layer"]: 1 - r["facts_kept"] for r in rows if r["ratio"] == ratio}
        whole = lost.pop("all")
        single = list(lost.values())
        print(
            f"  {ratio:>4.0f}x facts lost: all layers {whole:.3f}; one layer alone median "
            f"{statistics.median(single):.3f}, max {max(single):.3f}, sum {sum(single):.3f}"
        )
    return rows


def run_timing(model, tok, args: argparse.Namespace) -> list[dict]:
    """Seconds per stage of each AM variant at each context length: the median of
    `--timing-runs` runs, the variants taking turns within each run (so that a slow spell of
    the machine falls on all of them alike). Each row keeps its runs' totals."""
    from cdlm_serve.bench.load import austen_ids

    longest = austen_ids(args.model, max(args.timing_lengths))
    # Attention Matching's and the default's (auto: kvzip's keys, no fits) stages.
    methods = [m for m in args.methods if method_spec(m).name in (*AM_METHODS, AUTO_METHOD)]
    rows: list[dict] = []
    for length in args.timing_lengths:
        ids = longest[:length]
        full = model.new_cache(1, length + 64)
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device), cache=full)
        target = max(1, round(length / args.timing_ratio) - args.keep_recent)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
        for run in range(args.timing_runs):
            for method in methods:
                report = compact_method(model, tok, full.extract_row(0), ids, target, method, args)
                runs[method].append(report.seconds)
                print(
                    f"{length:>6} {method:<18} run {run + 1}  "
                    + "".join(f"{k} {report.seconds.get(k, 0.0):7.2f}s  " for k in STAGES),
                    flush=True,
                )
        for method in methods:
            stages = {k: statistics.median(r.get(k, 0.0) for r in runs[method]) for k in STAGES}
            rows.append(
                {
                    "tokens": length,
                    "method": method,
                    **stages,
                    "runs": [r["total"] for r in runs[method]],
                }
            )
        if args.json:
            save_json(args.json, {"timing": rows})
    _print_timing(rows, args, methods)
    return rows


def _print_timing(rows: list[dict], args: argparse.Namespace, methods: list[str]) -> None:
    threads = torch.get_num_threads()
    print(
        f"\ncompaction seconds, {args.timing_ratio:.0f}x, {args.dtype} model, fp32 fits, "
        f"{threads} threads, median of {args.timing_runs} run(s) per stage "
        "(queries / keys / beta / values = total)"
    )
    print(f"{'method':<20}" + "".join(f"{n:>34}" for n in args.timing_lengths))
    for method in methods:
        line = f"{method:<20}"
        for n in args.timing_lengths:
            r = next((r for r in rows if r["tokens"] == n and r["method"] == method), None)
            if r is None:
                line += f"{'-':>34}"
                continue
            parts = " / ".join(f"{r.get(k, 0.0):.1f}" for k in STAGES[:-1])
            line += f"{parts + ' = ' + format(r['total'], '.1f'):>34}"
        print(line)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument(
        "--text",
        help="a text file instead of Jane Austen, or 'python-reference': the Python language "
        "reference every Python install carries (pydoc_data.topics, ~65K words)",
    )
    p.add_argument("--contexts", type=int, default=5)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 3072, 4096, 5120, 6144])
    p.add_argument("--facts", type=int, default=20)
    p.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20, 50])
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(QUERY_SOURCE),
        help="METHOD[:QUERY_SOURCE][+int8][+attn|+measured|+global][+ctxkeys|+refkeys] (e.g. "
        "am-highest-fast:on-policy; +int8: the compacted segment kept as int8 codes; +attn: "
        "the KV heads' budgets by measured attention; +measured: by the model's schedule from "
        "bench/head_budgets.py; +global: by the method's own key scores over every head (kvzip, "
        "as its paper and kvpress); +ctxkeys / +refkeys: am-highest's keys ranked by the context's "
        "own queries / by the reference ones); the default source per method is the one its "
        "paper uses, and both am-highest variants rank their keys by the context's queries",
    )
    p.add_argument(
        "--peer",
        choices=["kvpress"],
        help="add another library's methods as rows: kvpress's presses as kvpress:<press> "
        "(bench/kvpress_peer.py, which says how to install it)",
    )
    p.add_argument(
        "--peer-presses",
        nargs="+",
        default=list(kvpress_peer.DEFAULT_PRESSES),
        choices=list(kvpress_peer.PRESSES),
        help="the kvpress presses --peer kvpress runs (also: kvpress:<press> in --methods)",
    )
    p.add_argument("--keep-recent", type=int, default=64)
    p.add_argument("--recon-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--timing", action="store_true", help="the speed curve instead of fidelity")
    p.add_argument(
        "--layer-loss",
        action="store_true",
        help="facts kept with one layer compacted at a time (the first of --methods), see above",
    )
    p.add_argument("--timing-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--timing-ratio", type=float, default=10)
    p.add_argument(
        "--timing-runs",
        type=int,
        default=1,
        help="runs per length (medians per stage; this machine's timings vary by +-15%%)",
    )
    p.add_argument(
        "--only",
        type=int,
        nargs="+",
        help="run only these context indices (the others are still drawn, so runs split this "
        "way see the same contexts as one run; merge them with --summarize)",
    )
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print (and with --json write) the tables of earlier runs' --json files, run nothing",
    )
    args = p.parse_args(argv)
    if args.peer == "kvpress":
        args.methods += [kvpress_peer.PREFIX + name for name in args.peer_presses]
    peers = [m for m in args.methods if kvpress_peer.is_peer(m)]
    for m in peers:
        kvpress_peer.press_name(m)  # an unknown press fails here, not after the first context
    if peers and (args.timing or args.layer_loss):
        raise SystemExit("kvpress rows are measured in the fidelity mode only")
    if args.summarize:
        rows = [r for f in args.summarize for r in json.loads(f.read_text())["rows"]]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        ratios = sorted({r["ratio"] for r in rows})
        summary = summarize(rows, ratios, methods)
        if args.json:
            save_json(args.json, {"rows": rows, "summary": summary})
        return rows

    folder, tok, model = load_bench_model(args.model, args.dtype)
    if args.timing:
        return run_timing(model, tok, args)
    hf = kvpress_peer.load_hf(folder, getattr(torch, args.dtype)) if peers else None
    text = long_text(args.text)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    for c in range(args.contexts):
        length = args.lengths[c % len(args.lengths)]
        context, facts, continuation = make_context(text, tok, length, args.facts, rng)
        if args.only is not None and c not in args.only:
            continue
        start = sequence_start(tok)
        ids = start + tok(context, add_special_tokens=False).input_ids
        recon = tok(RECON_INSTRUCTION, add_special_tokens=False).input_ids
        encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
        probe = Probe(
            facts=[(encode(f.question), encode(f.answer)) for f in facts],
            paraphrases=[(encode(f.paraphrase), encode(f.answer)) for f in facts],
            continuation=continuation,
            recon_prompt=recon + ids[len(start) : len(start) + 1],
            recon_target=ids[len(start) + 1 : len(start) + 1 + args.recon_tokens],
        )
        started = time.perf_counter()
        full = model.new_cache(1, len(ids) + 64)
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device), cache=full)
        prefill_s = time.perf_counter() - started
        captured = capture_references(model, tok, full, ids, args.methods)
        base_none = measure(model, None, probe, em=False, start=start)
        base_full = measure(model, full, probe, em=True)
        hf_prefill_s = kvpress_peer.prefill_seconds(hf, ids) if hf is not None else 0.0
        print(
            f"context {c}: {len(ids)} tokens, {len(facts)} facts, prefill {prefill_s:.1f}s; "
            f"fact NLL none {base_none['facts']:.2f} full {base_full['facts']:.2f}, "
            f"paraphrased none {base_none['para']:.2f} full {base_full['para']:.2f}, "
            f"EM full {base_full['em']:.0f}%",
            flush=True,
        )
        if args.layer_loss:
            base = (base_none, base_full)
            rows += run_layer_loss(model, tok, full, ids, probe, base, captured, args, c)
            if args.json:
                save_json(args.json, {"layer_loss": rows})
            continue
        for ratio in args.ratios:
            region = len(ids) - args.keep_recent
            target = max(1, round(len(ids) / ratio) - args.keep_recent)
            if target >= region:
                continue
            for method in args.methods:
                slots = target + args.keep_recent
                cache, report = compact_copy(
                    model, tok, hf, full, ids, slots, method, args, captured, hf_prefill_s
                )
                got = measure(model, cache, probe, em=True)
                row = {
                    "context": c,
                    "tokens": len(ids),
                    "method": method,
                    "ratio": ratio,
                    "physical": cache.lengths[0],
                    "facts_kept": kept(base_none["facts"], base_full["facts"], got["facts"]),
                    "para_kept": kept(base_none["para"], base_full["para"], got["para"]),
                    "cont_kept": kept(base_none["cont"], base_full["cont"], got["cont"]),
                    "recon_kept": kept(base_none["recon"], base_full["recon"], got["recon"]),
                    "facts_em": got["em"],
                    "facts_em_full": base_full["em"],
                    "out_err": report.output_error,
                    "bytes": resident_bytes(cache, report),
                    "disk_bytes": stored_bytes(cache, report),
                    "head_slots": report.head_slots,
                    "bytes_full": full.nbytes(0),
                    "seconds": report.seconds,
                }
                rows.append(row)
                if args.json:  # after every row, so a stopped run keeps what it measured
                    save_json(args.json, {"rows": rows})
                print(
                    f"  {ratio:>4.0f}x {method:<18} facts {row['facts_kept']:+.2f} para "
                    f"{row['para_kept']:+.2f} cont "
                    f"{row['cont_kept']:+.2f} recon {row['recon_kept']:+.2f} EM "
                    f"{row['facts_em']:.0f}% err {row['out_err']:.3f} "
                    f"{report.seconds['total']:.1f}s",
                    flush=True,
                )
    if args.layer_loss:
        return rows
    summary = summarize(rows, args.ratios, args.methods)
    if args.json:
        save_json(args.json, {"rows": rows, "summary": summary})
    return rows


def load_bench_model(name: str, dtype: str) -> tuple[Path, Any, Any]:
    """The model's folder, tokenizer and our model in `dtype` ("float32" / "bfloat16": then
    with the fused CPU kernels, as the server runs bf16)."""
    from transformers import AutoTokenizer

    folder = resolve(name)
    tok = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        kernels.enable_cpu_kernels()
    return folder, tok, model


def long_text(name: str | None) -> str:
    """The long text contexts are cut from, as one line."""
    if name is None:
        from cdlm_serve.train import austen

        return " ".join(austen.load(n) for n in austen.NOVELS).replace("\n", " ")
    if name == "python-reference":
        import pydoc_data.topics

        return " ".join(pydoc_data.topics.topics.values()).replace("\n", " ")
    return Path(name).read_text().replace("\n", " ")


def save_json(path: Path, obj: dict) -> None:
    from cdlm_serve.train.teacher import write_atomic

    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))


def summarize(rows: list[dict], ratios: list[float], methods: list[str]) -> list[dict]:
    """Median (and min..max) over contexts, per method and ratio; printed as tables."""
    out = []
    width = max(18, *(len(m) + 2 for m in methods))
    keys = ("facts_kept", "para_kept", "cont_kept", "recon_kept", "facts_em", "out_err")
    for key in (*keys, "bytes", "disk_bytes"):
        unit = 1e6 if key.endswith("bytes") else 1  # bytes as MB
        print(f"\n{key}{' (MB)' if unit > 1 else ''} (median over contexts, [min, max])")
        print(f"{'method':<{width}}" + "".join(f"{r:>18.0f}x" for r in ratios))
        for method in methods:
            line = f"{method:<{width}}"
            for ratio in ratios:
                vals = [
                    r[key] / unit
                    for r in rows
                    if r["method"] == method and r["ratio"] == ratio and key in r
                ]
                if not vals:
                    line += f"{'-':>19}"
                    continue
                med = statistics.median(vals)
                line += f"{med:>7.2f} [{min(vals):>4.1f},{max(vals):>4.1f}]"
                out.append({"method": method, "ratio": ratio, key: med})
            print(line)
    totals = {}
    for method in methods:
        secs = [r["seconds"]["total"] for r in rows if r["method"] == method]
        if secs:
            totals[method] = statistics.median(secs)
    print("\ncompaction seconds (median):", {k: round(v, 1) for k, v in totals.items()})
    return out


if __name__ == "__main__":
    main()
