"""A compaction method is one file: this one registers a method of its own (a head keeps its
region's last t slots, with Attention Matching's fits on them) and compacts with it through
`compact_row` and over HTTP, with no change anywhere else."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import Tensor

import tiny_models
from cdlm_serve.engine.compaction import (
    METHODS,
    CompactionMethod,
    CompactionRuntime,
    CompactionSpec,
    compact_row,
    register_method,
    unregister_method,
)
from cdlm_serve.models.loading import load_model
from conftest import app_in_thread


class LastSlots(CompactionMethod):
    name = "last_slots_test"
    query_source = "repeat"
    fits_beta = True
    fits_values = True

    def __init__(self) -> None:
        self.heads = 0

    def select(self, h, t, generator, budget) -> Tensor:
        self.heads += 1
        total = h.keys.shape[0]
        return torch.arange(total - t, total)


@pytest.fixture
def last_slots():
    method = register_method(LastSlots())
    yield method
    unregister_method(method.name)
    assert method.name not in METHODS


def test_a_method_registered_from_a_test_file_compacts_a_row(last_slots, tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(1, 256)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    before = [cache.read(0, layer)[0].clone() for layer in range(model.config.num_layers)]
    tok = tiny_models.byte_tokenizer()
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(16, method=last_slots.name),
        CompactionRuntime(tokenizer=tok),
    )
    assert report.method == last_slots.name and report.query_source == "repeat"
    assert cache.lengths == [16] and cache.logical == [80]
    assert last_slots.heads == model.config.num_layers * model.config.num_kv_heads
    for layer, keys in enumerate(before):
        # The keys it chose, as they were ([Hkv, 16, D]); beta fitted on them (not all zero).
        kept, _, bias = cache.read(0, layer)
        assert torch.equal(kept[:, :16], keys[:, 64:80])
        assert bias is not None and bias[:, :16].abs().sum() > 0


def test_an_unregistered_method_is_refused(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.tensor([list(range(40))]), cache=cache)
    tok = tiny_models.byte_tokenizer()
    with pytest.raises(ValueError, match="unknown compaction method 'last_slots_test'"):
        compact_row(
            model,
            cache,
            0,
            list(range(40)),
            CompactionSpec.exact(8, method="last_slots_test"),
            CompactionRuntime(tokenizer=tok),
        )


def test_a_registered_method_is_served_over_http(last_slots, tiny_llama_dir, tmp_path):
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec, ServerSettings

    settings = ServerSettings(
        [ModelSpec("tiny", str(tiny_llama_dir))],
        torch.device("cpu"),
        torch.float32,
        sessions_dir=tmp_path,
    )
    with app_in_thread(create_app(settings), healthy_within=120) as base:
        prompt = "It was a truth universally acknowledged. " * 3
        r = httpx.post(f"{base}/v1/sessions", json={"model": "tiny", "id": "s", "prompt": prompt})
        assert r.status_code == 201, r.text
        tokens = r.json()["tokens"]
        r = httpx.post(
            f"{base}/v1/sessions/s/compact",
            json={"ratio": 4, "method": last_slots.name},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["method"] == last_slots.name and r.json()["tokens_before"] == tokens
        assert r.json()["tokens_after"] == -(-tokens // 4)
        schema = httpx.get(f"{base}/openapi.json").json()
        props = schema["components"]["schemas"]["CompactRequest"]["properties"]
        assert last_slots.name in props["method"]["enum"]
        r = httpx.post(f"{base}/v1/sessions/s/compact", json={"ratio": 2, "method": "no_such"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "method", r.text
