"""Training and evaluation data for the models we train: task problems and Austen prose, as
fixed-shape (prompt, answer) token batches.

Every kind has a fixed prompt length and a batch has one answer length, so a batch needs no
padding. Task answers are padded with end-of-text tokens (the model learns to stop, as LLaDA's
SFT does) to `answer_len` plus a random number of extra whole blocks: the decoder rounds the
budget up to whole blocks, and a pilot trained on one fixed length (34) was exact at that budget
(97.5% addition) but broke down at 40. Prose continuations are exactly `answer_len` bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cdlm_serve.train import austen
from cdlm_serve.train.tasks import TASKS, Example
from cdlm_serve.train.tokenizer import EOS_ID, encode

# Held-out prose comes from one novel the model never trains on.
EVAL_NOVEL = "persuasion"
TRAIN_NOVELS = tuple(n for n in austen.NOVELS if n != EVAL_NOVEL)


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    prompt_len: int
    answer_len: int


BLOCK = 8  # answer lengths are whole blocks of this size (the student's block size)
MAX_EXTRA_BLOCKS = 3

KINDS = {
    "addition3": Kind("addition3", 8, 40),
    "trace4": Kind("trace4", 28, 40),
    "prose": Kind("prose", 64, 256),
}


def pad_answer(ids: list[int], length: int) -> list[int]:
    if len(ids) > length:
        raise ValueError(f"answer of {len(ids)} tokens does not fit {length}")
    return ids + [EOS_ID] * (length - len(ids))


def task_batch(examples: list[Example], kind: Kind, extra_blocks: int = 0) -> tuple[Tensor, Tensor]:
    """-> prompts [B, P], answers [B, answer_len + extra_blocks * BLOCK] (EOS-padded)."""
    prompts = [encode(ex.prompt) for ex in examples]
    if any(len(p) != kind.prompt_len for p in prompts):
        raise ValueError(f"{kind.name}: prompts must be {kind.prompt_len} tokens")
    length = kind.answer_len + extra_blocks * BLOCK
    answers = [pad_answer(encode(ex.answer), length) for ex in examples]
    return torch.tensor(prompts), torch.tensor(answers)


class ProseWindows:
    """Random byte windows of the training novels: prompt_len + answer_len bytes, starting at a
    paragraph or sentence boundary when one is near."""

    def __init__(self, novels: tuple[str, ...], kind: Kind, seed: int):
        self.data = b"\n".join(austen.load(n).encode("utf-8") for n in novels)
        self.kind = kind
        self.rng = random.Random(seed)

    def sample(self) -> list[int]:
        span = self.kind.prompt_len + self.kind.answer_len
        start = self.rng.randrange(0, len(self.data) - span - 200)
        # Start after the next space so a window never opens mid-word.
        start = self.data.index(b" ", start) + 1
        return list(self.data[start : start + span])

    def batch(self, n: int) -> tuple[Tensor, Tensor]:
        rows = torch.tensor([self.sample() for _ in range(n)])
        return rows[:, : self.kind.prompt_len], rows[:, self.kind.prompt_len :]


def held_out_prose(n: int, kind: Kind = KINDS["prose"], seed: int = 77) -> list[tuple[str, str]]:
    """Fixed held-out (prompt, true continuation) pairs from the evaluation novel, starting at
    paragraph starts so every prompt is a clean opening."""
    text = austen.load(EVAL_NOVEL).encode("utf-8")
    starts = [i + 1 for i, c in enumerate(text) if c == ord("\n")]
    span = kind.prompt_len + kind.answer_len
    starts = [s for s in starts if s + span < len(text)]
    rng = random.Random(seed)
    chosen = sorted(rng.sample(starts, n))
    out = []
    for s in chosen:
        window = text[s : s + span]
        out.append(
            (
                window[: kind.prompt_len].decode("utf-8", "replace"),
                window[kind.prompt_len :].decode("utf-8", "replace"),
            )
        )
    return out


class Mixture:
    """Round-robin over kinds with per-kind batch sizes that give similar token counts."""

    def __init__(
        self, seed: int, tokens_per_batch: int = 8192, weights: dict[str, int] | None = None
    ):
        self.rng = random.Random(seed)  # extra answer padding per batch
        self.weights = weights or {"addition3": 1, "trace4": 1, "prose": 1}
        self.streams = {name: TASKS[name].train_stream(seed) for name in ("addition3", "trace4")}
        self.prose = ProseWindows(TRAIN_NOVELS, KINDS["prose"], seed)
        self.tokens_per_batch = tokens_per_batch
        self.schedule = [k for k, w in self.weights.items() for _ in range(w)]

    def batch_size(self, kind: Kind) -> int:
        return max(1, self.tokens_per_batch // (kind.prompt_len + kind.answer_len))

    def batches(self, start_step: int = 0) -> Iterator[tuple[str, Tensor, Tensor]]:
        step = start_step
        while True:
            name = self.schedule[step % len(self.schedule)]
            kind = KINDS[name]
            n = self.batch_size(kind)
            if name == "prose":
                prompts, answers = self.prose.batch(n)
            else:
                extra = self.rng.randint(0, MAX_EXTRA_BLOCKS)
                examples = [next(self.streams[name]) for _ in range(n)]
                prompts, answers = task_batch(examples, kind, extra)
            yield name, prompts, answers
            step += 1
