"""Model work outside decoding, in chunks: the same numbers as one big forward."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.engine import model_work
from cdlm_serve.models.loading import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_models.hf_tiny("llama", folder)
    return load_model(folder)[0]


def test_chunked_prefill_and_prompt_logprobs_equal_one_forward(model, monkeypatch):
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        whole = model.new_cache(1, 64)
        logits = model.logits(model(torch.tensor([ids]), cache=whole))[0].float()
    logp = torch.log_softmax(logits, dim=-1)  # [P, V]
    monkeypatch.setattr(model_work, "CHUNK_TOKENS", 16)
    pieces: list[int] = []

    def on_engine(fn):
        pieces.append(1)
        return fn()

    cache = model_work.prefill(model, ids, on_engine)
    assert len(pieces) == 4 and cache.lengths == [50] and cache.logical == [50]
    for layer in range(len(cache.keys)):
        for a, b in zip(cache.read(0, layer)[:2], whole.read(0, layer)[:2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    scored = model_work.prompt_logprobs(model, ids, 3, on_engine)
    assert len(pieces) == 8 and [p.token for p in scored] == ids
    assert scored[0].logprob is None and scored[0].top is None
    for i, p in enumerate(scored[1:]):
        assert abs(p.logprob - float(logp[i, ids[i + 1]])) < 1e-4
        assert [t for t, _ in p.top] == logp[i].topk(3).indices.tolist()
