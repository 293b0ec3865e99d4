"""How much of the facts online compaction could keep at this size: bench.online_compaction's
runs (the same feed, policy, probe and contexts) with each head's slots chosen by a selection
that knows where the facts stand, against real selections through the same harness.

    python -m cdlm_serve.bench.compaction_ceiling [--contexts 3] [--selections oracle oracle+beta
                                       surprisal kvzip am-h2o ...] [--json out.json]

Every selection runs as `am-h2o` does (its reference and context queries, its policy), only the
keys differ; each run tracks which token of the context every slot of every (layer, KV head)
holds, so a slot kept once keeps its token's standing at the next compaction:

- `oracle`: three quarters of a head's slots to the facts' tokens, their answers (the code
  word and digits, and the token before them) first, then the rest of their statements, the
  most recent first among equals; an eighth to H2O's heavy hitters (attention accumulated by the
  context's queries), an eighth to the most recent slots; the kept slots' own keys, values and
  bias (no fit). No real method knows where the facts are: the ceiling of key selection here.
- `oracle+beta`: the same keys, beta fitted (Attention Matching's mass correction, am-h2o's fit).
- `surprisal`: half the slots recent, a quarter heavy hitters, a quarter by the tokens'
  surprisal (their NLL when appended: self-information, as Selective Context ranks tokens), no
  fit. A fact's code word and digits are the least predictable tokens of a fact.
- `kvzip`: KVzip's score, each key's largest attention from any repeat query (all of them:
  the harness keeps each layer's reference queries before the fits' sample), no fit: the
  engine's `kvzip`, whose online run this reproduces. `kvzip+beta`: beta fitted.
  `kvzip-mixed`: a quarter recent, a quarter heavy hitters, half by that score, no fit.
- `am-h2o`: H2O's keys with beta fitted, as the engine's method (this harness reproduces it:
  0.607 facts on context 0 against the online bench's 0.61).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cdlm_serve.bench import online_compaction as online
from cdlm_serve.bench.compaction import long_text, save_json
from cdlm_serve.engine.compaction import attention_matching as am
from cdlm_serve.engine.compaction import baselines
from cdlm_serve.engine.compaction import row as kv_compaction
from cdlm_serve.engine.compaction.attention_matching import HeadInputs, HeadResult
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import resolve

SELECTIONS = (
    "oracle",
    "oracle+beta",
    "surprisal",
    "kvzip",
    "kvzip+beta",
    "kvzip-mixed",
    "am-h2o",
)
# Each selection's shares of a head's slots: (recent, heavy hitters); the rest by its ranking.
SHARES = {
    "oracle": (1 / 8, 1 / 8),
    "surprisal": (1 / 2, 1 / 4),
    "kvzip": (0.0, 0.0),
    "kvzip-mixed": (1 / 4, 1 / 4),
}


@dataclass(eq=False)
class Tracker:
    """Which context token each slot of each (layer, KV head) holds, through appends and
    compactions, and each token's standing for the selection (`online.Watch`)."""

    layers: int
    heads: int
    selection: str
    ids: list[int]
    logits: Callable[[Tensor], Tensor]  # hidden [n, hidden] -> logits [n, vocab]
    standing: Tensor  # [len(ids)] the oracle's priorities, or the surprisal as appended
    positions: list[list[Tensor]] = field(default_factory=list)  # [layer][head] -> [slots]
    calls: int = 0
    repeat: dict[int, Tensor] = field(default_factory=dict)  # layer -> every repeat query
    chosen: dict[tuple[int, int], tuple[Tensor, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        empty = torch.zeros(0, dtype=torch.long)
        self.positions = [[empty] * self.heads for _ in range(self.layers)]

    def appended(self, start: int, hidden: Tensor) -> None:
        n = hidden.shape[0]
        if self.selection == "surprisal":  # the NLL of each next token, as the model read it
            following = torch.tensor(self.ids[start + 1 : start + n + 1])  # [<= n]
            nll = -torch.log_softmax(self.logits(hidden[: len(following)]).float(), -1)
            self.standing[start + 1 : start + 1 + len(following)] = nll[
                torch.arange(len(following)), following
            ].cpu()
        new = torch.arange(start, start + n)
        for layer in self.positions:
            for g in range(self.heads):
                layer[g] = torch.cat([layer[g], new])

    def compacting(self) -> None:
        self.calls, self.chosen = 0, {}

    def compacted(self) -> None:
        assert len(self.chosen) == self.layers * self.heads, "a head was not compacted"
        for (layer, g), (index, region) in self.chosen.items():
            held = self.positions[layer][g]
            self.positions[layer][g] = torch.cat([held[:region][index], held[region:]])

    def compact_head(
        self, h: HeadInputs, t: int, method: str, *_: object, **__: object
    ) -> HeadResult:
        """`kv_compaction.compact_head` while instrumented: heads come layer by layer, each
        layer's in order (the bench fits inline)."""
        layer, g = divmod(self.calls, self.heads)
        self.calls += 1
        region = h.keys.shape[0]
        index = self.select(h, t, self.positions[layer][g][:region], layer, g)
        self.chosen[(layer, g)] = (index, region)
        if self.selection.endswith("+beta") or self.selection == "am-h2o":
            return am.fit(h, index, values=False)
        return am.keep(h, index)

    def select(self, h: HeadInputs, t: int, positions: Tensor, layer: int, g: int) -> Tensor:
        """t of the region's slots (their tokens at `positions`), sorted."""
        if self.selection == "am-h2o":
            return baselines.h2o(h, t)
        recent, heavy = SHARES[self.selection.split("+")[0]]
        if self.selection.startswith("kvzip"):
            group = self.repeat[layer].shape[0] // self.heads
            pooled = self.repeat[layer][g * group : (g + 1) * group]  # [G, n, D]
            h.every_query = pooled.reshape(-1, h.keys.shape[1])
            return _mixed(h, t, recent, heavy, am.repeat_max_scores(h))
        return _mixed(h, t, recent, heavy, self.standing[positions])


def _mixed(h: HeadInputs, t: int, recent: float, heavy: float, standing: Tensor) -> Tensor:
    """t of the region's slots, sorted: the `recent` share most recent, the `heavy` share of
    H2O's heavy hitters, the rest by `standing` [T]."""
    region = h.keys.shape[0]
    chosen = torch.zeros(region, dtype=torch.bool)
    chosen[region - int(t * recent) :] = True
    if heavy > 0:
        hitters = baselines.accumulated_attention(h)
        hitters[chosen] = -1.0
        chosen[hitters.topk(int(t * heavy)).indices] = True
    rank = standing.clone()
    rank[chosen] = float("-inf")
    chosen[rank.topk(t - int(chosen.sum())).indices] = True
    return chosen.nonzero().flatten()


def oracle_standing(length: int, spans: list[online.Span]) -> Tensor:
    """[length] 2 for a fact's answer tokens and the one before, 1 for the rest of its
    statement, 0 elsewhere; later positions a little higher among equals."""
    standing = torch.arange(length, dtype=torch.float32) / (10.0 * length)
    for begin, answer, end in spans:
        standing[begin:end] += 1.0
        standing[answer - 1 : end] += 1.0
    return standing


@contextmanager
def instrumented(tracker: Tracker) -> Iterator[None]:
    """The engine's compactions choose their keys by `tracker` for the duration; each layer's
    reference queries (all of them, before the fits' sample) are kept for it."""
    real, real_fit = kv_compaction.compact_head, kv_compaction._LayerFit._fit

    def fit(self, layer: int, queries: Tensor, ranking):  # type: ignore[no-untyped-def]
        tracker.repeat = {layer: queries.cpu()}
        return real_fit(self, layer, queries, ranking)

    kv_compaction.compact_head = tracker.compact_head  # type: ignore[assignment]
    kv_compaction._LayerFit._fit = fit  # type: ignore[method-assign]
    try:
        yield
    finally:
        kv_compaction.compact_head = real
        kv_compaction._LayerFit._fit = real_fit


def run(model, tok, args, ids: list[int], selection: str, checkpoint, spans) -> dict:
    """One selection's online run on a context (`online.Feeder`), with its tracker."""
    cfg = model.config
    standing = oracle_standing(len(ids), spans) if selection.startswith("oracle") else None
    tracker = Tracker(
        cfg.num_layers,
        cfg.num_kv_heads,
        selection,
        ids,
        model.logits,
        torch.zeros(len(ids)) if standing is None else standing,
    )
    with instrumented(tracker):
        result = online.feed(model, tok, ids, args, "am-h2o", checkpoint, watch=tracker)
    return result | {"tracker": tracker}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    online.feed_arguments(p)
    p.add_argument("--selections", nargs="+", choices=SELECTIONS, default=list(SELECTIONS))
    args = p.parse_args(argv)
    args.methods, args.curve_every, args.dtype = args.selections, 0, "float32"

    from transformers import AutoTokenizer

    folder = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=torch.float32)
    text = long_text(args.text)
    rows: list[dict] = []

    def feeder(ids, selection, checkpoint, spans):
        return run(model, tok, args, ids, selection, checkpoint, spans)

    for c in range(args.contexts):
        rng = random.Random(args.seed + c)
        rows += online._context_runs(model, tok, text, rng, c, args, feeder)
        if args.json:
            save_json(args.json, {"args": vars(args) | {"json": str(args.json)}, "rows": rows})
    online._print(rows, args)
    return rows


if __name__ == "__main__":
    main()
