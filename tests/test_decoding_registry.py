"""A decoding mode is one file: this one registers a mode of its own (every masked position of a
block finalized by one full bidirectional pass) and serves it through the engine and over HTTP,
with no change anywhere else."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import torch
from torch import Tensor

import tiny_models
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
from cdlm_serve.engine.decoding.dlm_modes import (
    MODES,
    DecodeContext,
    DecodingMode,
    register,
    unregister,
)
from cdlm_serve.engine.decoding.dlm_modes.base import padded_tokens
from cdlm_serve.engine.decoding.dlm_sequence import BlockPass, DLMSequence
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from conftest import app_in_thread


@dataclass(slots=True)
class OnePassState:
    passes: int = 0


class OnePass(DecodingMode):
    name = "one_pass_test"

    def new_state(self) -> OnePassState:
        return OnePassState()

    def plan(self, seq: DLMSequence) -> BlockPass:
        full = torch.cat([torch.tensor(seq.prompt, device=seq.answer.device), seq.answer])
        return BlockPass(seq, full, 0, len(seq.prompt) + seq.block_start)

    def forward(self, ctx: DecodeContext, passes: list[BlockPass]) -> Tensor:
        tokens, valid = padded_tokens(ctx, passes)
        return ctx.runner.forward(tokens, pattern=AttentionPattern.bidirectional(), valid=valid)

    def after_pass(self, seq: DLMSequence) -> None:
        seq.state.passes += 1

    def forced_choice(
        self, ctx: DecodeContext, seq: DLMSequence, masked: Tensor, step: int
    ) -> Tensor | None:
        return masked  # the whole block at once


@pytest.fixture
def one_pass():
    mode = register(OnePass())
    yield mode
    unregister(mode.name)
    assert mode.name not in MODES


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada")
    tiny_models.llada_tiny(folder)
    return folder


def test_a_mode_registered_from_a_test_file_decodes(one_pass, llada_dir):
    model, _ = load_model(llada_dir)
    engine = DLMEngine(model, tiny_models.byte_tokenizer(), max_model_len=256)
    prompt = list(range(40, 52))
    seen: list[tuple[DLMSequence, Tensor, Tensor]] = []

    def check(seq: DLMSequence, logits: Tensor) -> None:
        # What the block's tokens must become: a full bidirectional recompute's argmax.
        ids = torch.cat([torch.tensor(seq.prompt), seq.answer])
        full = model.token_logits(model(ids[None], pattern=AttentionPattern.bidirectional()))
        start = len(seq.prompt) + seq.block_start
        want = full[0, start : start + seq.block_size].float()
        want[:, engine.mask_id] = float("-inf")
        seen.append((seq, logits, want.argmax(-1)))

    engine.on_step = check
    params = DLMParams(max_tokens=24, block_size=8, decoding=one_pass.name, ignore_eos=True)
    outs = list(engine.generate(prompt, params))
    answer = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason == "length" and len(answer) == 24
    assert outs[-1].steps == 3  # one pass per block of 8
    seq = seen[-1][0]
    assert seq.state.passes == 3  # the mode's own state, kept on the sequence
    blocks = [want.tolist() for _, _, want in seen]
    assert answer == [t for block in blocks for t in block]


def test_an_unregistered_mode_is_refused(llada_dir):
    model, _ = load_model(llada_dir)
    engine = DLMEngine(model, tiny_models.byte_tokenizer(), max_model_len=256)
    with pytest.raises(ValueError, match="decoding must be one of"):
        engine.new_sequence("x", [1, 2, 3], DLMParams(max_tokens=8, decoding="one_pass_test"))


def test_a_registered_mode_is_served_over_http(one_pass, llada_dir, tmp_path):
    from cdlm_serve.server.app import create_app
    from cdlm_serve.server.state import ModelSpec, ServerSettings

    settings = ServerSettings(
        [ModelSpec("dlm", str(llada_dir))],
        torch.device("cpu"),
        torch.float32,
        sessions_dir=tmp_path,
    )
    with app_in_thread(create_app(settings), healthy_within=120) as base:
        body = {"model": "dlm", "prompt": "ab", "max_tokens": 16, "block_size": 8}
        r = httpx.post(f"{base}/v1/completions", json={**body, "decoding": one_pass.name})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["steps"] == 2  # two blocks, one pass each
        schema = httpx.get(f"{base}/openapi.json").json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        assert one_pass.name in props["decoding"]["enum"]
        r = httpx.post(f"{base}/v1/completions", json={**body, "decoding": "no_such_mode"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "decoding"
