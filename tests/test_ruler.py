"""bench/ruler_tasks.py's RULER samples (each task fitted to its length in the real tokenizer's
tokens, holding the answers its question asks for and no other) and bench/ruler.py's rendering
and batched answers."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from transformers import AutoTokenizer

import tiny_models
from cdlm_serve.bench import ruler
from cdlm_serve.bench.compaction import long_text
from cdlm_serve.bench.facts import greedy
from cdlm_serve.bench.ruler_tasks import (
    GENERATE,
    NEEDLE,
    NIAH,
    TASKS,
    Generator,
    Sample,
    _sentences,
    string_match_all,
)
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.models.loading import load_model


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def generator():
    return Generator(long_text("python-reference"))


def _needles(context: str, kind: str) -> list[tuple[str, str]]:
    """Every (key, value) needle in a context."""
    pattern = re.escape(NEEDLE).replace(r"\{kind\}", kind)
    pattern = pattern.replace(r"\{key\}", "(.+?)").replace(r"\{value\}", r"([\w-]+)")
    return re.findall(pattern, context)


@pytest.mark.parametrize("task", TASKS)
def test_a_ruler_sample_fills_its_length_and_its_answers_are_what_its_question_asks(
    task, tok, generator
):
    length = 4096 if task == "cwe" else 1024  # cwe's 300 common entries take ~1,900 tokens
    render = ruler.chat_render(tok)
    sample = generator.sample(task, length, render, random.Random(f"{task}:0"))
    context, question = render(sample)
    budget = length - GENERATE[task]
    # as full as the haystack's grain allows (a needle of UUIDs is ~60 tokens), never over
    assert budget - 80 <= len(context) + len(question) <= budget
    assert sample.max_new_tokens == GENERATE[task]
    if task in NIAH:
        setting = NIAH[task]
        needles = _needles(sample.context, setting.value)
        asked = [k for k, _ in needles if k in sample.question]
        assert len(set(asked)) == setting.queries
        assert sorted(v for k, v in needles if k in asked) == sorted(sample.answers)
        assert len(sample.answers) == setting.queries * setting.values
        keys = {k for k, _ in needles}
        if setting.haystack == "needle":  # the haystack is distractor needles
            assert len(needles) >= 5
        else:
            assert len(keys) == setting.keys  # distractors: the other keys' needles
        assert all(sample.context.count(a) == 1 for a in sample.answers)
        # each asked needle sits at its depth: that share of the haystack's sentences before
        # it (the other needles not counted)
        sentences = _sentences(sample.context.split("\n", 1)[1])
        placed = needles if setting.haystack != "needle" else [n for n in needles if n[0] in asked]
        holds = [i for i, t in enumerate(sentences) if any(v in t for _, v in placed)]
        haystack = len(sentences) - len(holds)
        for value, depth in zip(sample.answers, sample.depths, strict=True):
            at = next(i for i in holds if value in sentences[i])
            before = at - sum(i < at for i in holds)
            assert abs(before / haystack - depth) <= 1 / haystack + 1e-9
    elif task == "vt":
        # Follow the chain from the value the question names: its variables are the answer.
        value = re.search(r"the value (\d+)", sample.question)[1]
        assigned = dict(re.findall(r"VAR (\w+) = (\w+(?: \w+)?)\.", sample.context))
        holding = {value}
        for var, rhs in assigned.items():  # the chain is in order
            if rhs.removeprefix("VAR ") in holding:
                holding.add(var)
        assert sorted(holding - {value}) == sorted(sample.answers)
        assert len(sample.answers) == 5
    else:
        words = Counter(re.findall(r"^\d+\. (\w+)$", sample.context, re.M))
        top = [w for w, _ in words.most_common(10)]
        assert sorted(top) == sorted(sample.answers)
        assert {words[w] for w in top} == {30}
        assert set(words.values()) == {30, 3}


def test_a_ruler_sample_is_its_seeds_and_keeps_its_needles_at_every_length(tok, generator):
    render = ruler.chat_render(tok)
    one = generator.sample("niah_multivalue", 1024, render, random.Random("s"))
    again = generator.sample("niah_multivalue", 1024, render, random.Random("s"))
    longer = generator.sample("niah_multivalue", 2048, render, random.Random("s"))
    other = generator.sample("niah_multivalue", 1024, render, random.Random("t"))
    assert one == again
    assert longer.answers == one.answers and longer.depths == one.depths
    assert len(render(longer)[0]) > 1.8 * len(render(one)[0])
    assert other.answers != one.answers


def test_a_rendered_sample_is_the_chat_templates_prompt_cut_after_its_context(tok, generator):
    render = ruler.chat_render(tok)
    sample = generator.sample("niah_single_2", 1024, render, random.Random("r"))
    context, question = render(sample)
    whole = tok.apply_chat_template(
        [{"role": "user", "content": f"{sample.context}\n{sample.question}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(context) + tok.decode(question) == whole + sample.answer_prefix
    assert tok.decode(context).endswith(sample.context)
    assert tok.decode(question).startswith("\n" + sample.question)


def test_string_match_all_is_the_share_of_answers_found():
    answers = ("123", "ABC-9", "x")
    assert string_match_all("the numbers are 123 and abc-9, x", answers) == 1.0
    assert string_match_all("123 and 12", answers) == pytest.approx(1 / 3)
    assert string_match_all("nothing", answers) == 0.0


def test_batched_answers_equal_each_caches_own_greedy_answer(tiny_llama_dir):
    """The bench answers a sample's caches (the full one, compacted ones of other lengths with
    their biases) in one batch: each row's answer must be the one it gives alone."""
    model, _ = load_model(tiny_llama_dir)
    tok = tiny_models.byte_tokenizer()
    context = [(11 * i) % 200 + 3 for i in range(160)]
    full = model.new_cache(1, len(context) + 64)
    with torch.no_grad():
        model(torch.tensor([context]), cache=full)
    caches = [full]
    for method, target in (("am-highest-fast", 40), ("snapkv", 20)):
        cache = full.extract_row(0)
        compact_row(
            model,
            cache,
            0,
            context,
            CompactionSpec.exact(target, method=method, query_source=None, keep_recent=8),
            CompactionRuntime(tokenizer=tok),
        )
        caches.append(cache)
    assert caches[1].biases is not None and len({c.lengths[0] for c in caches}) == 3
    sample = Sample("t", "", "", "", ("x",), max_new_tokens=12)
    question = [5, 17, 42, 99, 7]
    free = [greedy(model, c, question, 12) for c in caches]
    assert len({tuple(ids) for ids in free}) > 1  # the rows differ, so a mixed-up row shows
    # a stop token that ends one row early and the others later or never
    stop = {free[-1][4]}
    batched = ruler.answers(model, tok, caches, question, sample, stop)
    alone = [tok.decode(greedy(model, c, question, 12, stop)) for c in caches]
    assert batched == alone
    assert len({len(a) for a in alone}) > 1
