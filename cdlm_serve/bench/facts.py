"""The facts probe the compaction benchmarks share: made-up facts ("the code name of the blue
kettle is amber-415") spread through a window of prose, and how well a cache still knows them
(answer NLL against no context and the full one: `kept`), plus the probe's paraphrases, the
true continuation and a reconstruction of the passage."""

from __future__ import annotations

import random
import statistics
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.models.kv_cache import KVCache

COLORS = [
    "blue",
    "red",
    "green",
    "yellow",
    "black",
    "white",
    "purple",
    "orange",
    "silver",
    "golden",
    "brown",
    "grey",
    "pink",
    "violet",
    "crimson",
    "amber",
    "ivory",
    "teal",
    "scarlet",
    "indigo",
    "olive",
    "navy",
    "maroon",
    "cyan",
]
OBJECTS = [
    "box",
    "jar",
    "key",
    "lamp",
    "book",
    "coin",
    "ring",
    "cup",
    "chest",
    "bell",
    "map",
    "clock",
]
WORDS = [
    "Orchid",
    "Falcon",
    "Granite",
    "Willow",
    "Comet",
    "Harbor",
    "Juniper",
    "Lantern",
    "Meadow",
    "Nimbus",
    "Quartz",
    "Raven",
    "Saffron",
    "Tundra",
    "Velvet",
    "Zephyr",
    "Cobalt",
    "Ember",
    "Fjord",
    "Glacier",
]


@dataclass(slots=True)
class Fact:
    statement: str
    question: str
    answer: str  # what follows the question's answer prefix
    paraphrase: str  # the same question in other words (its answer prefix too)


def make_facts(n: int, rng: random.Random) -> list[Fact]:
    pairs = rng.sample([(c, o) for c in COLORS for o in OBJECTS], n)
    facts = []
    for color, obj in pairs:
        code = f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"
        facts.append(
            Fact(
                statement=f" The code name of the {color} {obj} is {code}.",
                question=f"\nQuestion: What is the code name of the {color} {obj}?\nAnswer: The "
                f"code name of the {color} {obj} is",
                answer=f" {code}.",
                paraphrase=f"\nQ: Which code word was given to the {obj} that is {color}?\nA: "
                f"The {color} {obj} was given the code word",
            )
        )
    return facts


def make_context(text: str, tok, length: int, n_facts: int, rng: random.Random):
    """A window of `text` of ~`length` tokens with facts spread through it, plus the true
    continuation (256 tokens) that follows it."""
    words = text.split(" ")
    start = rng.randrange(0, len(words) - 6 * length)
    facts = make_facts(n_facts, rng)
    body = " ".join(words[start : start + 2 * length])
    ids = tok(body, add_special_tokens=False).input_ids
    pieces = tok.decode(ids[: length - 15 * n_facts])
    sentences = pieces.split(". ")
    slots = sorted(rng.sample(range(1, len(sentences)), n_facts))
    for fact, slot in zip(reversed(facts), reversed(slots), strict=True):
        sentences[slot - 1] += "." + fact.statement.rstrip(".")
    context = ". ".join(sentences)
    rest = " ".join(words[start + 2 * length : start + 3 * length])
    continuation = tok(rest, add_special_tokens=False).input_ids[:256]
    return context, facts, continuation


@torch.no_grad()
def answer_nll(
    model, cache: KVCache | None, prompt: list[int], answer: list[int], start: Sequence[int] = ()
) -> float:
    """Mean NLL of `answer` after `prompt`, continuing `cache` (not modified) or from nothing
    (then after `start`: the BOS a model like Gemma needs to begin a sequence)."""
    if cache is None:
        prompt = [*start, *prompt]
    ids = torch.tensor([prompt + answer], device=model.device)
    if cache is None:
        hidden = model(ids)
    else:
        cache.ensure_capacity(cache.lengths[0] + ids.shape[1])
        hidden = model(ids, cache=cache, commit=False)
    return answer_loss(model, hidden[0], len(prompt), answer)


def answer_loss(model, hidden: Tensor, prompt: int, answer: list[int]) -> float:
    """Mean NLL of `answer` from the hidden states [n >= prompt + len(answer), hidden] of
    a prompt of `prompt` tokens followed by it."""
    logits = model.logits(hidden[prompt - 1 : prompt + len(answer) - 1]).float()
    return float(
        torch.nn.functional.cross_entropy(logits, torch.tensor(answer, device=model.device))
    )


@torch.no_grad()
def greedy(
    model, cache: KVCache, prompt: list[int], n: int, stop: Container[int] = ()
) -> list[int]:
    """n greedy tokens after `prompt` (fewer where one in `stop` comes, which ends them and
    is not returned), continuing a copy of `cache` (decode steps through the engines' runner:
    the fused CPU step where it applies)."""
    work = cache.extract_row(0)
    work.ensure_capacity(work.lengths[0] + len(prompt) + n + 1)
    runner = ModelRunner(model)
    hidden = model(torch.tensor([prompt], device=model.device), cache=work)[:, -1]  # [1, hidden]
    out = []
    for _ in range(n):
        token = int(model.logits(hidden).argmax(-1))
        if token in stop:
            break
        out.append(token)
        hidden = runner.extend([(0, [token])], work)
    return out


# The reconstruction probe's instruction: other words than the repeat instruction the
# reference queries are captured after (engine.compaction.row.REPEAT_INSTRUCTION), so that the
# probe is not the very input AM and KVzip were fitted on.
RECON_INSTRUCTION = (
    "\n\nNow write out once more the passage you have just read, from its start.\n\n"
)


@dataclass(slots=True)
class Probe:
    facts: list[tuple[list[int], list[int]]]  # (question ids, answer ids)
    paraphrases: list[tuple[list[int], list[int]]]  # (paraphrased question ids, answer ids)
    continuation: list[int]
    recon_prompt: list[int]
    recon_target: list[int]


def fact_nlls(
    model,
    cache: KVCache | None,
    probe: Probe,
    start: Sequence[int] = (),
    which: Iterable[int] | None = None,
) -> dict[int, float]:
    """Each fact's answer NLL after its question, by the fact's index in the probe (every
    fact, or those in `which`): what `measure` averages into "facts"."""
    chosen = range(len(probe.facts)) if which is None else which
    return {i: answer_nll(model, cache, *probe.facts[i], start) for i in chosen}


def measure(
    model,
    cache: KVCache | None,
    probe: Probe,
    em: bool,
    start: Sequence[int] = (),
    facts: Sequence[float] | None = None,
) -> dict[str, float]:
    """The probe's NLLs (and greedy exact match, `em`) continuing `cache`, or from nothing
    after `start` (`sequence_start`); `facts`: their `fact_nlls` where the caller has them."""
    facts = list(fact_nlls(model, cache, probe, start).values()) if facts is None else facts
    paraphrases = [answer_nll(model, cache, q, a, start) for q, a in probe.paraphrases]
    cont = probe.continuation
    out = {
        "facts": statistics.mean(facts),
        "para": statistics.mean(paraphrases),
        "cont": answer_nll(model, cache, cont[:1], cont[1:], start),
        "recon": answer_nll(model, cache, probe.recon_prompt, probe.recon_target, start),
    }
    if em and cache is not None:
        hits = [greedy(model, cache, q, len(a)) == a for q, a in probe.facts]
        out["em"] = 100.0 * sum(hits) / len(hits)
    return out


def sequence_start(tok) -> list[int]:
    """The BOS the tokenizer puts first, where it does (Gemma), else nothing (SmolLM2): a
    context, or a question asked without one, starts with it."""
    bos = tok.bos_token_id
    return [bos] if bos is not None and tok("a").input_ids[:1] == [bos] else []


def kept(none: float, full: float, method: float) -> float:
    return (none - method) / (none - full) if abs(none - full) > 1e-9 else float("nan")
