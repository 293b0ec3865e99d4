"""Gemma 3 (sliding-window layers, sandwich norms, GELU, scaled embeddings) on tiny random
checkpoints: its cache, its engine runs and its GGUF, against transformers' Gemma3."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.loading import load_model

WINDOW = tiny_models.GEMMA3_TINY["sliding_window"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    hf = tiny_models.hf_tiny("gemma3", folder)
    ours, _ = load_model(folder, dtype=torch.float32)
    return hf, ours


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_window_layers_see_only_their_window(pair):
    """The model is Gemma's, window included: changing a token further back than the window
    changes the next token's logits only through the global layer."""
    hf, ours = pair
    ids = _ids(40, 1)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids))
    assert (ref - got).abs().max().item() <= 1e-4
    assert ours.config.local_layers == [0, 2] and ours.cache_index == [0, 0, 1]


# 2: the smallest forward that needs more than the window (window + 1 slots); 58: one that
# needs 65 slots, one past a multiple of 64 (the ring's step).
@pytest.mark.parametrize("chunk", [2, 5, 11, 40, 58])
def test_chunked_prefill_matches_one_forward_and_the_ring_stays_bounded(pair, chunk):
    """Prefilled in chunks, then two more tokens on a ring trimmed back to the window: every
    position's logits are transformers' over the whole sequence at once (a ring a slot short
    loses the oldest position a chunk's first query sees)."""
    hf, ours = pair
    ids = _ids(90, 2, batch=2)
    cache = ours.new_cache(batch=2, capacity=8)
    outs = []
    with torch.no_grad():
        ref = hf(ids).logits
        for start in range(0, 90, chunk):
            outs.append(ours.logits(ours(ids[:, start : start + chunk], cache=cache)))
            # A forward of Q tokens needs window + Q - 1 slots: the ring grows to that alone
            # (a multiple of 64).
            assert cache.window.ring == max(WINDOW, -(-(WINDOW + chunk - 1) // 64) * 64)
        assert cache.lengths == [90, 90] and cache.logical == [90, 90]
        # What a copy or a session's segment keeps: the window - 1 positions a later query
        # sees, not the whole grown ring.
        assert cache.window.ordered(1, 90)[0][0].shape[1] == WINDOW - 1
        cache.trim()
        assert cache.window.ring == WINDOW  # back to the window, positions kept
        more = torch.tensor([[5, 7], [6, 8]])  # two tokens: the ring grows again for them
        outs.append(ours.logits(ours(more, cache=cache)))
        ref_next = hf(torch.cat([ids, more], dim=1)).logits[:, -2:]
    assert (torch.cat(outs[:-1], dim=1) - ref).abs().max().item() <= 1e-4
    assert (outs[-1] - ref_next).abs().max().item() <= 1e-4


def test_rows_copied_between_caches_keep_their_window(pair):
    """extract_row / load_row / move_row carry the ring's positions (relaid out for another
    ring size): a row continued elsewhere gives the same logits."""
    _, ours = pair
    ids = _ids(30, 3, batch=2)
    with torch.no_grad():
        cache = ours.new_cache(batch=2, capacity=8)
        ours(ids, cache=cache)  # the ring grew to hold 30 new tokens
        row = cache.extract_row(1)
        assert row.window.ring == WINDOW and row.logical == [30]
        other = ours.new_cache(batch=3, capacity=4)
        other.load_row(2, row)
        other.move_row(2, 0)
        nxt = torch.tensor([[9]])
        want = ours.logits(ours(nxt, cache=row))
        got = ours.logits(ours(nxt, cache=other, rows=(0, 1)))
    assert (want - got).abs().max().item() <= 1e-5


def _run(engine: AREngine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [t for out in engine.generate(prompt, params) for t in out.token_ids]


def test_engine_batches_like_transformers_generate(pair):
    """Continuous batching with prompts prefilled in chunks (6 tokens a step), requests
    joining mid-run, rows longer than the window: every answer equals transformers' greedy
    generate. The prefix cache is off for window models (it stores global slots only)."""
    hf, ours = pair
    tok = tiny_models.byte_tokenizer()
    engine = AREngine(
        ours, tok, 256, max_batch=2, prefill_tokens=6, prefix_cache=PrefixCache(1 << 20)
    )
    assert engine.prefix_cache is None
    reqs = [(list(range(60, 80)), 12), ([65, 66, 67], 15), (list(range(100, 113)), 9)]
    want = []
    with torch.no_grad():
        for prompt, n in reqs:
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                pad_token_id=tiny_models.PAD_ID,
            )  # fmt: skip
            want.append(out[0, len(prompt) :].tolist())
    assert _run(engine, *reqs[0]) == want[0]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    seqs = [engine.new_sequence(f"r{i}", p, params[i]) for i, (p, _) in enumerate(reqs)]
    got: dict[str, list[int]] = {}
    for seq in seqs:
        engine.add(seq)  # the third waits for a row
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got[f"r{i}"] for i in range(3)] == want
    # The ring grew for the prompts' chunks of 6 tokens, no further.
    assert engine.cache.window.ring <= WINDOW + 6 - 1 + 63


def _write_gemma3_gguf(path: Path, hf_model) -> None:
    """A GGUF as llama.cpp's converter writes Gemma 3 (written independently here): its
    tensor names, norm weights stored as 1 + w, no q/k permutation (NeoX RoPE)."""
    from gguf import GGUFWriter

    cfg = hf_model.config
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(tiny_models.BOS_ID)
    w.add_eos_token_id(tiny_models.EOS_ID)
    names = {
        "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate",
        "up_proj": "ffn_up", "down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    }  # fmt: skip
    for name, t in hf_model.state_dict().items():
        arr = t.float().numpy()
        parts = name.split(".")
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
        if gname.endswith("norm.weight"):
            arr = (arr + 1.0).astype(np.float32)
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_gemma3_loads_as_transformers_reads_it(tmp_path):
    """llama.cpp hard-codes Gemma 3's layer pattern (every 6th global) and local RoPE base
    (10K): a 6-layer tiny model with those, written as llama.cpp writes it, loads exactly."""
    hf = tiny_models.hf_tiny(
        "gemma3", tmp_path / "hf", num_hidden_layers=6, layer_types=None,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=16, tie_word_embeddings=True,
    )  # fmt: skip
    _write_gemma3_gguf(tmp_path / "g.gguf", hf)
    ours, ckpt = load_model(tmp_path / "g.gguf")
    cfg = ckpt.config
    assert cfg.family == "gemma3" and cfg.sliding_window == WINDOW
    assert cfg.local_layers == [0, 1, 2, 3, 4] and cfg.attention_scale == 16**-0.5
    ids = _ids(40, 4)
    with torch.no_grad():
        assert (hf(ids).logits - ours.logits(ours(ids))).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def long_gemma_dir(tmp_path_factory):
    """The tiny Gemma 3 with room for an 8K-token session."""
    folder = tmp_path_factory.mktemp("gemma3-long")
    tiny_models.hf_tiny("gemma3", folder, max_position_embeddings=16384)
    return folder


def test_an_8k_session_holds_window_sized_rings_through_http_and_a_restart(
    long_gemma_dir, tmp_path
):
    """A session of 8K tokens over real HTTP: its global layer holds a slot per token, its
    sliding-window layers a window each (the bytes say so exactly); it continues exactly as
    the whole prompt would, in memory and after a restart (its ring read back from the
    segment file); a compaction shrinks its global layer alone (the rings stay the window)."""
    import httpx

    from conftest import tiny_session_server

    cfg = tiny_models.GEMMA3_TINY
    kv = 2 * 2 * cfg["head_dim"] * 4  # K and V, 2 KV heads, fp32: bytes per slot and layer
    text = "".join(chr(97 + (i * 7) % 26) for i in range(8000))  # 8,000 byte tokens
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0}

    def complete(base: str, **extra) -> str:
        r = httpx.post(f"{base}/v1/completions", json=body | extra, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with tiny_session_server(long_gemma_dir, tmp_path) as base:
        r = httpx.post(
            f"{base}/v1/sessions", json={"model": "tiny", "id": "long", "prompt": text},
            timeout=300,
        )  # fmt: skip
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["tokens"] == info["physical_tokens"] == 8000
        # One global layer's 8,000 slots, two window layers' 8 slots each: nothing more.
        assert info["bytes"] == 8000 * kv + 2 * WINDOW * kv
        whole = complete(base, prompt=text + "Q:")
        assert complete(base, prompt="Q:", session_id="long", append=False) == whole
    with tiny_session_server(long_gemma_dir, tmp_path) as base:
        assert complete(base, prompt="Q:", session_id="long", append=False) == whole
        # A uniform method: every head keeps ratio-th of the global layer, so the bytes are exact
        # (the default, auto, shares the slots unevenly: its row is its longest head's).
        r = httpx.post(
            f"{base}/v1/sessions/long/compact",
            json={"ratio": 4, "method": "am-highest"},
            timeout=600,
        )
        assert r.status_code == 200, r.text
        info = httpx.get(f"{base}/v1/sessions/long").json()
        kept = info["physical_tokens"]
        assert kept <= 2000 and info["logical_length"] == 8000
        # Its slots, each with a bias per KV head (4 bytes), and the same two rings.
        assert info["bytes"] == kept * (kv + 2 * 4) + 2 * WINDOW * kv
        assert complete(base, prompt="Q:", session_id="long", append=False)  # it continues


def test_compaction_fits_the_global_layers_and_leaves_the_windows(pair):
    """Attention Matching on a window model compacts its global layers only (the paper's
    rule): their slots shrink to the target, the window layers' rings stay as they were,
    the logical length is kept, and the compacted row continues closer to the full one than
    a random choice of slots does (am-omp on repeat queries vs the random baseline)."""
    from cdlm_serve.engine import model_work
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    _, ours = pair
    tok = tiny_models.byte_tokenizer()
    ids = _ids(160, 5)[0].tolist()
    full = model_work.prefill(ours, ids)
    probe = torch.tensor([[5, 6, 7, 8]])

    def continued(cache) -> torch.Tensor:
        with torch.no_grad():
            return ours.logits(ours(probe, cache=cache.extract_row(0)))[0]

    want = continued(full)
    rings = full.window.ordered(0, 160)
    errors = {}
    for method in ("am-omp", "random"):
        cache = full.extract_row(0)
        report = compact_row(
            ours,
            cache,
            0,
            ids,
            CompactionSpec.exact(40, method=method, query_source="repeat"),
            CompactionRuntime(tokenizer=tok),
        )
        assert cache.lengths == [40] and cache.logical == [160] and report.region == 160
        assert cache.window.ring == WINDOW  # the repeat pass grew it; given back
        for got, kept in zip(cache.window.ordered(0, 160), rings, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, kept, strict=True))
        errors[method] = ((continued(cache) - want).norm() / want.norm()).item()
    assert errors["am-omp"] < 0.6 * errors["random"]


def _kept_slots_reference(hf, ids: list[int], kept: list[int], more: list[int]) -> torch.Tensor:
    """transformers' logits [len(more), V] for `more` after `ids`, where the new tokens' global
    layer sees only the positions `kept` of `ids` (and the new tokens), every other attention
    as usual: what a row whose global layer holds only those original slots must give. The
    prompt's own tokens attend as they did at prefill (their K/V were made then)."""
    n, past = len(ids) + len(more), len(ids)
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]  # [Q, K]
    sliding = causal & (pos[None, :] > pos[:, None] - WINDOW)
    full = causal.clone()
    dropped = torch.ones(past, dtype=torch.bool)
    dropped[kept] = False
    full[past:, :past] &= ~dropped

    def additive(visible: torch.Tensor) -> torch.Tensor:
        return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]

    masks = {"full_attention": additive(full), "sliding_attention": additive(sliding)}
    with torch.no_grad():
        return hf(torch.tensor([ids + more]), attention_mask=masks).logits[0, past:]


def test_a_compacted_row_continues_as_transformers_over_its_kept_positions(pair):
    """A compaction that keeps original slots (streaming: the global layer's first and most
    recent ones, each with its own value and no bias) leaves a row that continues as
    transformers does over the whole sequence with the dropped positions hidden from the new
    tokens: the kept slots at their own positions (the new tokens placed by the logical
    length, not the slot count), the windows' rings as they were. Two new tokens: they need
    one slot more than the ring, which the compaction trimmed back to the window."""
    from cdlm_serve.engine import model_work
    from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row

    hf, ours = pair
    ids = _ids(160, 5)[0].tolist()
    cache = model_work.prefill(ours, ids)
    layer = ours.cache_index[ours.config.global_layers[0]]  # the global layer's cache index
    original = cache.read(0, layer)[0].clone()  # [Hkv, 160, D]
    tok = tiny_models.byte_tokenizer()
    compact_row(
        ours,
        cache,
        0,
        ids,
        CompactionSpec.exact(24, method="streaming", query_source="repeat", keep_recent=16),
        CompactionRuntime(tokenizer=tok),
    )
    assert cache.lengths == [40] and cache.logical == [160] and cache.window.ring == WINDOW
    keys, _, bias = cache.read(0, layer)
    assert bias is None or not bias.any()
    match = (keys[:, :, None, :] == original[:, None, :, :]).all(-1)  # [Hkv, 40, 160]
    assert bool((match.sum(-1) == 1).all())  # each kept slot is one original position
    kept = match.float().argmax(-1)  # [Hkv, 40]
    assert all(torch.equal(k, kept[0]) for k in kept)  # the same positions for every head
    assert kept[0].unique().numel() == 40 and kept[0][0] == 0 and kept[0][-1] == 159
    more = [5, 7]
    with torch.no_grad():
        got = ours.logits(ours(torch.tensor([more]), cache=cache))[0]
        whole = hf(torch.tensor([ids + more])).logits[0, -2:]
    # The reference's masks as transformers reads them: keeping every position is its own
    # unmasked forward.
    assert (_kept_slots_reference(hf, ids, list(range(160)), more) - whole).abs().max() <= 1e-4
    want = _kept_slots_reference(hf, ids, kept[0].tolist(), more)
    assert (want - whole).abs().max() > 1e-2  # the dropped positions mattered
    assert (got - want).abs().max().item() <= 1e-4


def test_decode_steps_attend_through_the_fused_kernel_as_sdpa_does(tmp_path, monkeypatch):
    """bf16 on the CPU kernels, a decode step on the PyTorch path (the fused step turned off
    here; tests/test_cpu_kernels.py has Gemma's) attends through the fused attention kernel:
    the window ring's slots out of the window and a shorter row's padding as -inf bias. Two
    rows of different lengths, past the window (the ring wrapped), get the logits SDPA's path
    gives, to bf16 rounding."""
    from cdlm_serve.engine.decoding.model_runner import ModelRunner
    from cdlm_serve.models import kernels
    from cpu_features import skip_unless

    skip_unless("avx2", kernels.enable_cpu_kernels(), "the fused CPU kernels")
    monkeypatch.setattr(ModelRunner, "stack", lambda self: None)
    tiny_models.hf_tiny("gemma3", tmp_path, head_dim=32)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16)
    calls = []
    fused = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a: calls.append(1) or fused(*a))
    prompts = [_ids(20, 5)[0].tolist(), _ids(11, 6)[0].tolist()]
    steps = _ids(12, 7, batch=2).tolist()

    def run() -> torch.Tensor:
        runner, cache = ModelRunner(model), model.new_cache(2, 8)
        runner.extend([(0, prompts[0]), (1, prompts[1])], cache)
        out = []
        with torch.no_grad():
            for i in range(12):
                hidden = runner.extend([(0, [steps[0][i]]), (1, [steps[1][i]])], cache)
                out.append(model.logits(hidden).float())
        assert cache.logical == [32, 23] and cache.window.ring >= WINDOW
        return torch.stack(out)

    got = run()
    assert len(calls) == 12 * 3  # every step, every layer (2 window, 1 global)
    with kernels.cpu_kernels(False):
        ref = run()
    assert len(calls) == 12 * 3
    assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
