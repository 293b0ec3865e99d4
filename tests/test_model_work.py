"""Model work outside decoding goes through the AR engine: a session's prefill is a sequence
of max_tokens 0, an echoed prompt's logprobs are scored as its chunks are prefilled. Both give
the numbers of one big forward, in chunks between other rows' decode steps."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.engine import model_work
from cdlm_serve.engine.decoding import AREngine, PrefixCache, SamplingParams
from cdlm_serve.engine.sessions.session import Session
from cdlm_serve.models.loading import load_model

IDS = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_models.hf_tiny("llama", folder)
    return load_model(folder)[0]


@pytest.fixture()
def engine(model):
    engine = AREngine(model, tiny_models.byte_tokenizer(), 512, prefill_tokens=16)
    engine.prefix_cache = PrefixCache(1 << 20, block=8)
    return engine


def _one_forward(model):
    with torch.no_grad():
        whole = model.new_cache(1, 64)
        logits = model.logits(model(torch.tensor([IDS]), cache=whole))[0].float()
    return whole, torch.log_softmax(logits, dim=-1)  # [P, V]


def _drain(engine, beside: str = "other") -> dict[str, list]:
    """Every output per request until the engine is idle; the row `beside` decodes at every
    step while the others prefill."""
    outs: dict[str, list] = {}
    while engine.has_work():
        step = engine.step()
        ids = {o.request_id for o in step}
        assert beside in ids or (beside in outs and outs[beside][-1].finish_reason)
        for out in step:
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _beside(engine) -> None:
    keep = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add(engine.new_sequence("other", [3, 4, 5], keep))
    engine.step()  # decoding already when the others arrive


def test_prompt_logprobs_are_scored_in_the_prefill_chunks_and_skip_the_prefix_cache(model, engine):
    _, logp = _one_forward(model)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    list(engine.generate(IDS, greedy))  # the prompt's blocks are in the prefix cache now
    assert engine.prefix_cache.match(IDS)
    _beside(engine)
    asked = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
    engine.add(engine.new_sequence("scored", IDS, asked))
    outs = _drain(engine)["scored"]
    first, rest = outs[0], outs[1:]
    assert [o.prompt_logprobs for o in rest] == [None] * len(rest)  # the first output only
    scored = first.prompt_logprobs
    assert [p.token for p in scored] == IDS[1:]  # nothing predicts the first
    for i, p in enumerate(scored):  # position i predicts token i + 1, across chunk borders
        assert abs(p.logprob - float(logp[i, IDS[i + 1]])) < 1e-4
        assert [t for t, _ in p.top] == logp[i].topk(3).indices.tolist()
    assert outs[-1].cached_tokens == 0  # every prompt token ran through the model


def test_a_prefill_only_sequence_writes_the_prompt_into_its_session(model, engine):
    whole, _ = _one_forward(model)
    _beside(engine)
    session = Session("s", "m", [], None)
    engine.add(engine.new_sequence("fill", IDS, SamplingParams(max_tokens=0), session=session))
    (out,) = _drain(engine)["fill"]
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", "length")
    assert session.tokens == IDS and session.next_input is None
    cache = session.cache
    assert cache.lengths == [50] and cache.logical == [50] and cache.capacity == 50
    for layer in range(len(cache.keys)):
        for a, b in zip(cache.read(0, layer)[:2], whole.read(0, layer)[:2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # It continues as a session written by an answer would: the same tokens as the whole
    # prompt alone.
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [t for o in engine.generate([*IDS, 7, 8], greedy) for t in o.token_ids]
    engine.add(engine.new_sequence("next", [7, 8], greedy, session=session))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == alone


def test_a_prefill_still_needs_room_for_an_answer(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.new_sequence("x", list(range(512)), SamplingParams(max_tokens=0))


def test_the_plain_prefill_equals_one_forward(model, monkeypatch):
    whole, _ = _one_forward(model)
    monkeypatch.setattr(model_work, "CHUNK_TOKENS", 16)
    cache = model_work.prefill(model, IDS)
    assert cache.lengths == [50] and cache.logical == [50]
    for layer in range(len(cache.keys)):
        for a, b in zip(cache.read(0, layer)[:2], whole.read(0, layer)[:2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
