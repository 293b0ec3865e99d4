"""Training pieces: task generators, data batches, the Austen corpus, the teacher objective."""

from __future__ import annotations

import random
import re

import pytest
import torch

from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.train import austen
from cdlm_serve.train.data import KINDS, Mixture, held_out_prose, task_batch
from cdlm_serve.train.tasks import TASKS, Addition, Trace
from cdlm_serve.train.teacher import TeacherConfig, export_model, masked_diffusion_loss, new_model
from cdlm_serve.train.tokenizer import EOS_ID, MASK_ID


def test_addition_chain_of_thought_is_correct():
    rng = random.Random(0)
    task = Addition(3)
    for _ in range(200):
        ex = task.sample(rng)
        a, b = map(int, ex.prompt[:-1].split("+"))
        *columns, result = ex.answer.split(",")
        assert int(result.lstrip("=")) == a + b
        carry = 0
        for (x, y), col in zip(zip(str(a)[::-1], str(b)[::-1], strict=True), columns, strict=True):
            m = re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d\d)", col)
            assert m and (m[1], m[2], int(m[3])) == (x, y, carry)
            assert int(m[4]) == int(x) + int(y) + carry
            carry = int(m[4]) // 10


def test_trace_values_follow_the_code():
    rng = random.Random(1)
    for _ in range(200):
        ex = Trace(4).sample(rng)
        env: dict[str, int] = {}
        for stmt in ex.answer.rstrip(";").split(";"):
            lhs, expr, val = re.fullmatch(r"(\w)=(.+?)\s*=(\d)", stmt).groups()
            assert eval(expr, {}, dict(env)) == int(val)
            env[lhs] = int(val)
        assert ex.prompt == "".join(s[: s.rindex("=")] + ";" for s in ex.answer[:-1].split(";"))


@pytest.mark.parametrize("name", list(TASKS))
def test_held_out_is_fixed_and_never_trained_on(name):
    task = TASKS[name]
    held = task.held_out()
    assert len(held) == 500 and len({ex.prompt for ex in held}) == 500
    assert held == task.held_out()
    stream = task.train_stream(seed=3)
    prompts = {ex.prompt for ex in held}
    assert not any(next(stream).prompt in prompts for _ in range(3000))


def test_task_batches_have_fixed_shapes():
    kind = KINDS["addition3"]
    prompts, answers = task_batch(list(TASKS["addition3"].held_out()[:5]), kind)
    assert prompts.shape == (5, kind.prompt_len) and answers.shape == (5, kind.answer_len)
    assert (answers[:, -1] == EOS_ID).all()  # padded with end-of-text
    _, longer = task_batch(list(TASKS["addition3"].held_out()[:5]), kind, extra_blocks=2)
    assert (
        longer.shape[1] == kind.answer_len + 16 and (longer[:, kind.answer_len :] == EOS_ID).all()
    )
    mix = Mixture(seed=1)
    lengths = {
        a.shape[1] for name, _, a in (next(mix.batches(0)) for _ in range(1)) if name == "addition3"
    }
    assert lengths and all(n % 8 == 0 for n in lengths)


def test_austen_corpus_and_prose_batches():
    text = austen.load("persuasion")
    assert text.startswith("Persuasion") or "Sir Walter Elliot" in text[:3000]
    assert len(text) > 400_000
    mix = Mixture(seed=0)
    name, prompts, answers = next(mix.batches(2))  # step 2 of the round robin is prose
    assert name == "prose" and prompts.shape[1] == 64 and answers.shape[1] == 256
    pairs = held_out_prose(5)
    assert len(pairs) == 5 and all(len(p.encode()) <= 64 for p, _ in pairs)


def test_teacher_objective_learns_and_exports(tmp_path):
    cfg = TeacherConfig(d_model=64, layers=2, heads=1, mlp=128).hf_config()
    model = new_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kind = KINDS["addition3"]
    prompts, answers = task_batch(list(TASKS["addition3"].held_out()[:32]), kind)
    pattern = AttentionPattern.bidirectional()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        loss = masked_diffusion_loss(model, prompts, answers, pattern, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    export_model(model, cfg, tmp_path / "model")
    loaded, ckpt = load_model(tmp_path / "model")
    assert ckpt.config.family == "llada" and ckpt.config.mask_token_id == MASK_ID
    ids = torch.cat([prompts[:2], answers[:2]], 1)
    with torch.no_grad():
        assert torch.allclose(loaded.logits(loaded(ids)), model.logits(model(ids)), atol=1e-5)
