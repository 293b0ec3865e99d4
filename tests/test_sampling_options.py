"""The sampling options users send (issue 56 item 3): presence, frequency and repetition
penalties, logit_bias and min_p, applied to the step's logits of the rows that ask for them,
in one pass; their ranges checked where the request enters."""

from __future__ import annotations

import httpx
import pytest
import torch

from cdlm_serve.engine.decoding import SamplingParams
from cdlm_serve.engine.decoding.sampling import Adjusted, adjust_logits, draw

PROMPT = [5, 9, 5, 12, 30, 7]


@pytest.fixture(scope="module")
def engine(tiny_ar_engine):
    return tiny_ar_engine


def _tokens(engine, prompt, **kw) -> list[int]:
    return [t for o in engine.generate(prompt, SamplingParams(**kw)) for t in o.token_ids]


def test_adjustments_by_hand():
    logits = torch.tensor([[2.0, -1.0, 4.0, 0.5, -3.0, 1.0], [1.0] * 6]).to(torch.bfloat16)
    rows = [
        Adjusted(
            SamplingParams(
                repetition_penalty=2.0,
                presence_penalty=0.5,
                frequency_penalty=0.25,
                logit_bias={5: 3.0, 0: -1.0},
            ),
            prompt=[0, 1],
            counts={2: 3, 4: 1},
        ),
        Adjusted(SamplingParams(), prompt=[0], counts={1: 2}),  # asks for nothing
    ]
    out = adjust_logits(logits, rows)
    # Token 0: prompt (2 / 2), bias -1. 1: prompt (-1 x 2). 2: answer x3 (4 / 2 - 0.5 - 0.75).
    # 3: untouched. 4: answer x1 (-3 x 2 - 0.5 - 0.25). 5: bias +3.
    want = torch.tensor([[0.0, -2.0, 0.75, 0.5, -6.75, 4.0], [1.0] * 6])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want)
    assert logits[0, 0] == 2.0  # the step's own logits are left as they were


def test_draws_follow_the_weights_and_never_take_a_zero_one():
    """`draw` (the inverse of the cumulative distribution, in place of torch.multinomial):
    each token as often as its share of the row's sum, whatever the sum; a weight of 0
    never; the same generator seed, the same tokens."""
    weights = torch.tensor([0.0, 1.0, 0.0, 6.0, 3.0, 0.0, 0.0, 2.0, 0.0])  # sum 12
    n = 60_000
    for scale in (1.0, 1 / 12, 1e-30):  # any positive sum: a row need not be normalized
        g = torch.Generator().manual_seed(3)
        drawn = draw((weights * scale).expand(n, -1), g)  # [n]: one draw per row
        counts = torch.bincount(drawn, minlength=len(weights)).double()
        share = weights.double() / weights.sum()
        sigma = (n * share * (1 - share)).sqrt()
        assert ((counts - n * share).abs() <= 5 * sigma).all(), (scale, counts)
        assert counts[weights == 0].sum() == 0
    # One positive weight, first or last: only it.
    for only in (0, 8):
        one_hot = torch.zeros(9).index_fill_(0, torch.tensor(only), 0.5)
        assert set(draw(one_hot.expand(500, -1), None).tolist()) == {only}
    a, b = (draw(weights.expand(50, -1), torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b)


def test_greedy_answers_follow_the_adjusted_logits_every_step(engine):
    """Replayed with one whole forward per step and the penalties applied by hand, the
    engine's answer is the argmax at every step (the counts grow as the answer does), and it
    differs from the plain greedy answer."""
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True)
    plain = _tokens(engine, PROMPT, **kw)
    opts = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3)
    got = _tokens(engine, PROMPT, **kw, **opts)
    assert got != plain
    model = engine.model
    for i, token in enumerate(got):
        with torch.no_grad():
            cache = model.new_cache(1, 64)
            hidden = model(torch.tensor([PROMPT + got[:i]]), cache=cache)
            logits = model.logits(hidden[0, -1:]).float()  # [1, V]
        counts: dict[int, int] = {}
        for t in got[:i]:
            counts[t] = counts.get(t, 0) + 1
        adjusted = adjust_logits(logits, [Adjusted(SamplingParams(**opts), PROMPT, counts)])
        assert int(adjusted.argmax()) == token, i


def test_logit_bias_forces_and_bans_tokens(engine):
    kw = dict(max_tokens=8, temperature=0, ignore_eos=True)
    plain = _tokens(engine, PROMPT, **kw)
    assert _tokens(engine, PROMPT, **kw, logit_bias={77: 100.0}) == [77] * 8
    banned = _tokens(engine, PROMPT, **kw, logit_bias={t: -100.0 for t in set(plain)})
    assert not set(banned) & set(plain)
    # Sampled too: a token banned at temperature 1 is never drawn.
    sampled = _tokens(engine, PROMPT, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                      logit_bias={t: -100.0 for t in range(0, 128)})  # fmt: skip
    assert all(t >= 128 for t in sampled)


def test_min_p_one_keeps_only_the_most_likely_token(engine):
    kw = dict(max_tokens=10, ignore_eos=True)
    greedy = _tokens(engine, PROMPT, temperature=0, **kw)
    assert _tokens(engine, PROMPT, temperature=1.0, seed=1, min_p=1.0, **kw) == greedy
    assert _tokens(engine, PROMPT, temperature=1.0, seed=1, **kw) != greedy


def test_a_row_without_options_is_unchanged_beside_one_with_them(engine):
    kw = dict(max_tokens=10, temperature=0, ignore_eos=True)
    alone = _tokens(engine, PROMPT, **kw)
    engine.add(engine.new_sequence("plain", PROMPT, SamplingParams(**kw)))
    engine.add(engine.new_sequence("biased", PROMPT, SamplingParams(**kw, logit_bias={3: 50.0})))
    got: dict[str, list[int]] = {"plain": [], "biased": []}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got["plain"] == alone and got["biased"] == [3] * 10


@pytest.fixture(scope="module")
def base(tiny_ar_and_dlm_server):
    return tiny_ar_and_dlm_server


def test_over_http_the_options_work_and_bad_values_are_400s(base):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, timeout=120)

    body = {"model": "tiny", "prompt": "ab", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = post("/v1/completions", {**body, "logit_bias": {"120": 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x" * 6, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5,
            "repetition_penalty": 1.2, "min_p": 0.1}  # fmt: skip
    assert post("/v1/chat/completions", chat).status_code == 200
    bad = [
        ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"a": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"presence_penalty": 2.5}, "presence_penalty", ""),
        ({"repetition_penalty": 0}, "repetition_penalty", ""),
        ({"min_p": 1.5}, "min_p", ""),
    ]
    for extra, param, words in bad:
        r = post("/v1/completions", {**body, **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, (extra, r.text)
        assert words in error["message"], (extra, error)
    for extra in ({"presence_penalty": 1.0}, {"logit_bias": {"5": 1}}, {"min_p": 0.2}):
        r = post("/v1/completions", {"model": "dream", "prompt": "ab", "max_tokens": 8, **extra})
        param = next(iter(extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"] == f"{param} is not supported for diffusion models"
