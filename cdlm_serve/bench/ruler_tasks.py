"""RULER's synthetic tasks, generated here as RULER defines them (Hsieh et al. 2024, "RULER:
What's the Real Context Size of Your Long-Context Language Models?", scripts/data/synthetic):
needle-in-a-haystack in eight settings, variable tracking and common-word extraction, each
sample fitted to a length in the model's own tokens. The templates, needles and answer prefixes
are RULER's words; what differs, and why:

- The "essay" haystack is Jane Austen (`train/austen.py`), not Paul Graham's essays: nothing is
  downloaded here. The "noise" haystack is RULER's own repeated sentences.
- Keys ("words") are two words of the haystack text joined by a hyphen where RULER draws an
  adjective and a noun from `wonderwords`; `cwe`'s words are the text's too. Values: 7-digit
  numbers or UUIDs, as RULER's.
- `vt` and `cwe` are zero-shot (RULER prepends one worked example); the few-shot example would
  be part of the compacted context and cost a short context a large share of it.

A sample is split where compaction cuts it: `context` (the instruction and the haystack: what a
session holds and compacts) and `question` (asked after it, never compacted), plus RULER's
`answer_prefix`, which follows the assistant's turn header. Scoring is RULER's
`string_match_all`: the share of the expected strings found in the answer (case ignored).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}"
)
NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}"
)
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
# (RULER's prefix spells "assgined"; the model reads it, so it is kept as RULER ships it.)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {n} "
    "variables are assgined the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}"
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


@dataclass(frozen=True, slots=True)
class NiahSetting:
    """One of RULER's needle-in-a-haystack configurations (its synthetic.yaml)."""

    haystack: str  # "noise" | "essay" | "needle" (a haystack of distractor needles)
    key: str  # "words" | "uuids"
    value: str  # "numbers" | "uuids"
    keys: int = 1  # needles with other keys (distractors) beside the asked one
    values: int = 1  # values the asked key has
    queries: int = 1  # keys asked at once


NIAH = {
    "niah_single_1": NiahSetting("noise", "words", "numbers"),
    "niah_single_2": NiahSetting("essay", "words", "numbers"),
    "niah_single_3": NiahSetting("essay", "words", "uuids"),
    "niah_multikey_1": NiahSetting("essay", "words", "numbers", keys=4),
    "niah_multikey_2": NiahSetting("needle", "words", "numbers"),
    "niah_multikey_3": NiahSetting("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSetting("essay", "words", "numbers", values=4),
    "niah_multiquery": NiahSetting("essay", "words", "numbers", keys=4, queries=4),
}
# RULER's tokens_to_generate per task: the answer's room, counted inside the length.
GENERATE = {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120}
TASKS = tuple(GENERATE)
DISTRACTORS = 8192  # needles a haystack of needles can hold (~25 tokens each: 200K tokens)
NOISE_MOST = 1 << 20  # noise repeats: no limit short of memory


@dataclass(frozen=True, slots=True)
class Sample:
    task: str
    context: str  # the instruction and the haystack: what is compacted
    question: str  # asked after the context (the user turn's end)
    answer_prefix: str  # after the assistant's turn header
    answers: tuple[str, ...]  # each must appear in the answer
    max_new_tokens: int
    depths: tuple[float, ...] = ()  # where the asked needles sit, 0 (start) to 1 (end)


# A sample's tokens once rendered: (context ids, question ids incl. the answer prefix).
Render = Callable[[Sample], tuple[list[int], list[int]]]


def string_match_all(prediction: str, answers: tuple[str, ...]) -> float:
    """RULER's score of one answer: the share of `answers` that appear in it, case ignored."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def vocabulary(text: str, size: int = 8000) -> list[str]:
    """The `size` most common lower-case words of 4-10 letters in `text`, sorted: where keys
    and cwe's words are drawn from (the haystack's own words, as RULER's are ordinary English)."""
    words = Counter(re.findall(r"\b[a-z]{4,10}\b", text))
    return sorted(w for w, _ in words.most_common(size))


@dataclass(slots=True)
class Generator:
    """Makes samples of any task at a length from one text, each from the random stream it
    is given."""

    text: str  # the essay haystack's source, one line
    _words: list[str] = field(init=False)
    _vocab: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self._words = self.text.split(" ")
        self._vocab = vocabulary(self.text)

    def sample(self, task: str, length: int, render: Render, rng: random.Random) -> Sample:
        """A sample of `task` whose rendered tokens are at most `length` less the answer's
        room, and as close to it as the haystack's grain allows (RULER's binary search on the
        haystack's size). Its random draws are made once, so every size tried holds the same
        needles at the same depths."""
        if task not in GENERATE:
            raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
        build, most = self._builder(task, rng)
        budget = length - GENERATE[task]

        def fits(n: int) -> bool:
            return _tokens(render, build(n)) <= budget

        if not fits(1):
            raise ValueError(f"{task} does not fit in {length} tokens")
        lo, hi = 1, 2  # haystack sizes: lo fits, hi does not (doubled until it does not)
        while fits(min(hi, most)):
            lo = min(hi, most)
            if lo == most:
                raise ValueError(f"the text is too short to fill {task} to {length} tokens")
            hi *= 2
        hi = min(hi, most)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return build(lo)

    def _builder(self, task: str, rng: random.Random) -> tuple[Callable[[int], Sample], int]:
        """The task's sample as a function of its haystack's size, and the largest size the
        text allows."""
        if task in NIAH:
            return self._niah(task, NIAH[task], rng)
        return self._vt(rng) if task == "vt" else self._cwe(rng)

    # -- needles -----------------------------------------------------------------------------

    def _key(self, kind: str, rng: random.Random) -> str:
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return f"{rng.choice(self._vocab)}-{rng.choice(self._vocab)}"

    @staticmethod
    def _value(kind: str, rng: random.Random) -> str:
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return str(rng.randint(1_000_000, 9_999_999))

    def _niah(
        self, task: str, s: NiahSetting, rng: random.Random
    ) -> tuple[Callable[[int], Sample], int]:
        kind = s.value
        keys = list(dict.fromkeys(self._key(s.key, rng) for _ in range(4 * s.keys)))[: s.keys]
        needles = [(k, self._value(s.value, rng)) for k in keys for _ in range(s.values)]
        rng.shuffle(needles)
        depths = [rng.random() for _ in needles]
        asked = rng.sample(keys, s.queries)
        query = asked[0] if s.queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        answers = tuple(v for k, v in needles if k in asked)
        start = self._sentence_start(rng.randrange(0, len(self._words) // 2))
        # a haystack of needles: distractors with keys and values of the same kinds
        distractors = [
            (self._key(s.key, rng), self._value(s.value, rng)) for _ in range(DISTRACTORS)
        ]
        distractors = [p for p in distractors if p[0] not in keys]

        def build(n: int) -> Sample:
            if s.haystack == "noise":
                sentences = _sentences(" ".join([NOISE] * n))
            elif s.haystack == "essay":
                sentences = _sentences(" ".join(self._words[start : start + n]))
            else:
                pairs = distractors[:n]
                sentences = [NEEDLE.format(kind=kind, key=k, value=v) for k, v in pairs]
            placed = [
                (d, NEEDLE.format(kind=kind, key=k, value=v))
                for d, (k, v) in zip(depths, needles, strict=True)
            ]
            context = " ".join(_insert(sentences, placed))
            asked_depths = tuple(d for d, (k, _) in zip(depths, needles, strict=True) if k in asked)
            return Sample(
                task,
                NIAH_TEMPLATE.format(kind=kind, context=context),
                NIAH_QUESTION.format(kind=kind, query=query),
                NIAH_PREFIX.format(kind=kind, query=query),
                answers,
                GENERATE[task],
                asked_depths,
            )

        most = {"needle": len(distractors), "essay": len(self._words) - start}
        return build, most.get(s.haystack, NOISE_MOST)

    def _sentence_start(self, word: int) -> int:
        """The first word at or after `word` that begins a sentence (the essay haystack starts
        as RULER's essays do, not mid-sentence)."""
        while word > 0 and not self._words[word - 1].endswith((".", "!", "?")):
            word += 1
        return word

    # -- variable tracking -------------------------------------------------------------------

    def _vt(self, rng: random.Random, hops: int = 4) -> tuple[Callable[[int], Sample], int]:
        """One chain of `hops` + 1 variables (RULER's default: 1 chain, 4 hops): the first
        assigned a 5-digit number, each next one the previous one; every variable of the
        chain is the answer. Its statements sit at rising random depths of the noise."""
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)
        ]
        depths = sorted(rng.random() for _ in chain)

        def build(n: int) -> Sample:
            sentences = _sentences(" ".join([NOISE] * n))
            context = " ".join(_insert(sentences, list(zip(depths, chain, strict=True))))
            return Sample(
                "vt",
                VT_TEMPLATE.format(context=context),
                VT_QUESTION.format(query=value),
                VT_PREFIX.format(n=len(names), query=value),
                tuple(names),
                GENERATE["vt"],
                tuple(depths),
            )

        return build, NOISE_MOST

    # -- common words ------------------------------------------------------------------------

    def _cwe(
        self, rng: random.Random, common: int = 10, freq: int = 30, rare_freq: int = 3
    ) -> tuple[Callable[[int], Sample], int]:
        """A numbered list: `common` words `freq` times each and rare words `rare_freq` times
        each (RULER's 10, 30 and 3), shuffled; the common ones are the answer. The haystack's
        size is the number of rare words."""
        words = rng.sample(self._vocab, len(self._vocab))
        top, rare = words[:common], words[common:]
        order = rng.random  # one shuffle key per entry, drawn as entries are added

        keys: list[float] = []

        def build(n: int) -> Sample:
            entries = [w for w in top for _ in range(freq)]
            entries += [w for w in rare[:n] for _ in range(rare_freq)]
            while len(keys) < len(entries):
                keys.append(order())
            ranked = [w for _, w in sorted(zip(keys, entries, strict=False))]
            listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(ranked))
            return Sample(
                "cwe",
                CWE_TEMPLATE.format(context=listing),
                CWE_QUESTION,
                CWE_PREFIX,
                tuple(top),
                GENERATE["cwe"],
            )

        return build, len(rare)


def _sentences(text: str) -> list[str]:
    """`text` cut after each full stop (the stop kept with its sentence)."""
    return [s for s in re.split(r"(?<=\.) ", text) if s]


def _insert(sentences: list[str], placed: list[tuple[float, str]]) -> list[str]:
    """`sentences` with each (depth, needle) put between sentences at that fraction of them;
    needles at the same place keep their order."""
    out = list(sentences)
    for depth, needle in sorted(placed, key=lambda p: p[0], reverse=True):
        out.insert(round(depth * len(sentences)), needle)
    return out


def _tokens(render: Render, sample: Sample) -> int:
    context, question = render(sample)
    return len(context) + len(question)
