"""Attention patterns, per-key biases, position offsets and the KV cache interface."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tiny_models
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.transformer import new_capture
from cpu_features import ISAS, kernel_build


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = tiny_models.hf_tiny("llama", folder)
    ours, _ = load_model(folder)
    return hf, ours


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny_models.VOCAB, (batch, n), generator=gen)


def test_block_causal_pattern_definition():
    pattern = AttentionPattern.block_causal(block_size=4, block_start=6)
    pos = torch.arange(20).view(1, -1)
    got = pattern.allowed(pos, pos)[0]

    def block(i: int) -> int:
        return 0 if i < 6 else 1 + (i - 6) // 4

    want = torch.tensor([[block(k) <= block(q) for k in range(20)] for q in range(20)])
    assert torch.equal(got, want)
    # The prompt (before block_start) is one bidirectional block; answer blocks see it all.
    assert got[0, 5] and not got[5, 6] and got[9, 6] and got[9, 9] and not got[9, 10]


def test_per_row_block_start():
    pattern = AttentionPattern.block_causal(2, torch.tensor([1, 3]))
    pos = torch.arange(5).expand(2, 5)
    got = pattern.allowed(pos, pos)
    assert got[0, 0, 1].item() is False and got[1, 0, 2].item() is True


def test_block_causal_forward_matches_hf_with_the_same_mask(llama_pair):
    hf, ours = llama_pair
    pattern = AttentionPattern.block_causal(block_size=8, block_start=10)
    ids = _ids(42, batch=2)
    pos = torch.arange(42).expand(2, 42)
    mask = pattern.allowed(pos, pos)[:, None]  # [B, 1, Q, K]
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        got = ours.logits(ours(ids, pattern=pattern))
    assert (expected - got).abs().max().item() <= 1e-4


def test_block_by_block_with_cache_equals_full_recompute(llama_pair):
    """The CDLM cache discipline: prefill the prompt, run a block without committing (its
    scratch slots are overwritten each pass), commit it once final, move on."""
    _, ours = llama_pair
    prompt, block, n_blocks = 10, 8, 3
    pattern = AttentionPattern.block_causal(block, prompt)
    ids = _ids(prompt + block * n_blocks, seed=1)
    with torch.no_grad():
        full = ours.logits(ours(ids, pattern=pattern))
        cache = ours.new_cache(1, 8)
        ours(ids[:, :prompt], cache=cache, pattern=pattern)
        for b in range(n_blocks):
            sl = slice(prompt + b * block, prompt + (b + 1) * block)
            scratch = torch.full((1, block), tiny_models.MASK_ID)
            ours(scratch, cache=cache, pattern=pattern, commit=False)  # a "denoising" pass
            assert cache.lengths == [prompt + b * block]
            got = ours.logits(ours(ids[:, sl], cache=cache, pattern=pattern, commit=False))
            assert (got - full[:, sl]).abs().max().item() <= 1e-4
            ours(ids[:, sl], cache=cache, pattern=pattern, commit=block)
        assert cache.lengths == cache.logical == [prompt + block * n_blocks]


def test_position_offset_is_invisible_to_a_causal_model(llama_pair):
    """RoPE scores depend on relative positions only, so shifting a whole sequence changes
    nothing: this checks that per-row position offsets reach every layer."""
    _, ours = llama_pair
    ids = _ids(30, batch=2)
    base = torch.arange(30).expand(2, 30)
    offset = base + torch.tensor([[100], [7]])
    with torch.no_grad():
        a = ours.logits(ours(ids, positions=base))
        b = ours.logits(ours(ids, positions=offset))
        c = ours.logits(ours(ids, positions=base.flip(-1)))  # a scrambled order must differ
    assert (a - b).abs().max().item() <= 1e-4
    assert (a - c).abs().max().item() > 1e-2


def _decode_one(model, cache, token: int) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor([[token]]), cache=cache))[0, -1]


def test_key_bias_log2_equals_a_duplicated_key(llama_pair):
    """beta = log 2 on a slot weighs it exactly like two copies of it."""
    _, ours = llama_pair
    ids = _ids(12, seed=3)
    i, j = 3, 7  # slot j will become a copy of slot i
    dup = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids, cache=dup)
    comp = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids, cache=comp)
    keys, values, biases = [], [], []
    keep = [s for s in range(12) if s != j]
    for layer in range(ours.config.num_layers):
        dup.keys[layer][0, :, j] = dup.keys[layer][0, :, i]
        dup.values[layer][0, :, j] = dup.values[layer][0, :, i]
        k, v, _ = comp.read(0, layer)
        keys.append(k[:, keep])
        values.append(v[:, keep])
        bias = torch.zeros(k.shape[0], len(keep))
        bias[:, keep.index(i)] = torch.log(torch.tensor(2.0))
        biases.append(bias)
    comp.replace_prefix(0, 12, keys, values, biases)
    assert comp.lengths == [11] and comp.logical == [12]
    a = _decode_one(ours, dup, 42)
    b = _decode_one(ours, comp, 42)
    assert (a - b).abs().max().item() <= 1e-4
    # Without the bias the duplicate's weight is lost and the answer changes.
    for bias in comp.biases:
        bias.zero_()
    comp.reset(0, 11)
    c = _decode_one(ours, comp, 42)
    assert (a - c).abs().max().item() > 1e-3


def test_replace_prefix_keeps_logical_positions(llama_pair):
    """Compacting a prefix into itself (t = T, beta = 0) changes nothing, the tail moves
    down, and the next token still gets position T."""
    _, ours = llama_pair
    ids = _ids(20, seed=4)
    ref = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids, cache=ref)
    cache = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids, cache=cache)
    # "Compact" the first 12 slots into the 12 same slots with zero bias.
    segs = [cache.read(0, layer) for layer in range(ours.config.num_layers)]
    cache.replace_prefix(
        0,
        12,
        [k[:, :12].clone() for k, _, _ in segs],
        [v[:, :12].clone() for _, v, _ in segs],
        [torch.zeros(k.shape[0], 12) for k, _, _ in segs],
    )
    assert cache.lengths == [20] and cache.logical == [20]
    assert (_decode_one(ours, ref, 5) - _decode_one(ours, cache, 5)).abs().max().item() <= 1e-5
    assert cache.next_positions(1, torch.device("cpu")).item() == 21

    # A smaller segment: fewer physical slots, same logical length.
    cache2 = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids, cache=cache2)
    segs = [cache2.read(0, layer) for layer in range(ours.config.num_layers)]
    cache2.replace_prefix(
        0,
        12,
        [k[:, :4].clone() for k, _, _ in segs],
        [v[:, :4].clone() for _, v, _ in segs],
        [torch.zeros(k.shape[0], 4) for k, _, _ in segs],
    )
    assert cache2.lengths == [12] and cache2.logical == [20]
    assert cache2.next_positions(1, torch.device("cpu")).item() == 20
    k_tail, _, _ = cache2.read(0, 0)
    assert torch.equal(k_tail[:, 4:], segs[0][0][:, 12:20])  # tail moved down intact


def test_uncommitted_passes_leave_no_trace(llama_pair):
    _, ours = llama_pair
    ids = _ids(16, seed=5)
    a, b = ours.new_cache(1, 32), ours.new_cache(1, 32)
    with torch.no_grad():
        ours(ids[:, :10], cache=a)
        ours(ids[:, :10], cache=b)
        for _ in range(3):
            ours(_ids(6, seed=9), cache=b, commit=False)
        ours(ids[:, 10:], cache=a)
        ours(ids[:, 10:], cache=b)
    assert a.lengths == b.lengths == [16]
    for layer in range(ours.config.num_layers):
        assert torch.equal(a.keys[layer][:, :, :16], b.keys[layer][:, :, :16])


@pytest.mark.parametrize("biased", [False, True])
def test_long_masked_attention_runs_in_bounded_chunks(llama_pair, monkeypatch, biased):
    """A long forward over a cache (a re-compaction's repeat pass, say) never hands SDPA a
    mask or score matrix over all [B, H, Q, K] at once, and computes the same thing."""
    import torch.nn.functional as F

    from cdlm_serve.models import flash_continuation, layers

    monkeypatch.setattr(flash_continuation, "_FLASH", None)  # the masked path (GPUs, etc.)
    _, model = llama_pair
    ids = _ids(40)
    cache = model.new_cache(1, 128)
    with torch.no_grad():
        model(ids[:, :30], cache=cache)
        if biased:  # compacted slots carry a bias: the mask becomes float and per head
            cache.biases = [torch.zeros(1, 2, cache.capacity) for _ in range(len(cache.keys))]
            for bias in cache.biases:
                bias[0, :, :30] = torch.linspace(-2, 1, 30)
        whole = model(ids[:, 30:], cache=cache, commit=False)
        budget = 4 * 2 * 4 * 40  # 4 query rows x 4 heads x 40 keys (x 2 for headroom)
        monkeypatch.setattr(layers, "ATTENTION_CHUNK_ELEMENTS", budget)
        seen: list[int] = []
        sdpa = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, **kw):
            seen.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
            if attn_mask is not None:
                seen.append(attn_mask.numel())
            return sdpa(q, k, v, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        chunked = model(ids[:, 30:], cache=cache, commit=False)
    assert len(seen) > 2 * len(model.layers) and max(seen) <= budget
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def _continued(model, prefix: torch.Tensor, capacity: int, biased: bool):
    """A cache holding `prefix` [1, n]; `biased`: its slots carry a bias ramp from -2 to 1
    (as compacted slots carry beta)."""
    cache = model.new_cache(1, capacity)
    model(prefix, cache=cache)
    if biased:
        n = prefix.shape[1]
        cache.biases = [torch.zeros(1, 2, cache.capacity) for _ in range(len(cache.keys))]
        for bias in cache.biases:
            bias[0, :, :n] = torch.linspace(-2, 1, n)
    return cache


def _staged(model, ids, cache, band) -> torch.Tensor:
    """The hidden states of a staged continuation of `cache` (under `band`), run to the end."""
    stages = model.forward_stages(ids, cache=cache, commit=False, band=band)
    try:
        while True:
            next(stages)
    except StopIteration as done:
        return done.value


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_continuation_on_a_cpu_runs_flash_parts_equal_to_the_masked_path(
    llama_pair, monkeypatch, biased, dtype
):
    """New tokens after a cache (causal among themselves, every cached slot visible, with its
    bias) attend through the CPU flash kernel in parts merged by log-sum-exp: the same result
    as the masked SDPA path, whole or in paused query chunks, and no [Q, K] mask is built."""
    from cdlm_serve.models import flash_continuation, layers

    _, model = llama_pair
    model = model.to(dtype)
    ids = _ids(40)
    with torch.no_grad():
        cache = _continued(model, ids[:, :30], 128, biased)
        masks: list[int] = []
        real = flash_continuation._FLASH

        def spy(q, k, v, *args, attn_mask=None, **kw):
            masks.append(0 if attn_mask is None else attn_mask.numel())
            return real(q, k, v, *args, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(flash_continuation, "_FLASH", spy)
        flash = model(ids[:, 30:], cache=cache, commit=False)
        monkeypatch.setattr(layers, "STAGE_ATTENTION_ELEMENTS", 3 * 4 * 40)  # 3 rows a piece
        staged = _staged(model, ids[:, 30:], cache, None)
        calls = len(masks)
        monkeypatch.setattr(flash_continuation, "_FLASH", None)
        masked = model(ids[:, 30:], cache=cache, commit=False)
    model.to(torch.float32)
    assert calls >= 2 * len(model.layers) and max(masks) <= 4 * 30  # a bias row per head
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(flash, masked, atol=tol, rtol=tol)
    torch.testing.assert_close(staged, masked, atol=tol, rtol=tol)


def test_staged_forward_equals_forward_in_many_small_pieces(llama_pair, monkeypatch):
    from cdlm_serve.models import layers

    _, model = llama_pair
    ids = _ids(40)
    with torch.no_grad():
        cache = model.new_cache(1, 128)
        model(ids[:, :25], cache=cache)
        whole = model(ids[:, 25:], cache=cache, commit=False)
        monkeypatch.setattr(layers, "STAGE_ATTENTION_ELEMENTS", 4 * 40)  # 1 row x 4 heads
        monkeypatch.setattr(layers, "STAGE_MLP_TOKENS", 4)
        stages = model.forward_stages(ids[:, 25:], cache=cache, commit=False)
        items = []
        try:
            while True:
                items.append(next(stages))
        except StopIteration as done:
            staged = done.value
    queries = [q for q in items if q is not None]
    assert len(queries) == len(model.layers) and queries[0].shape == (1, 4, 15, 16)
    assert len(items) >= len(model.layers) * (15 + 4)  # a piece per query row and MLP chunk
    torch.testing.assert_close(staged, whole, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [25]  # commit=False: nothing kept


def test_a_staged_pass_without_a_cache_reads_only_the_keys_up_to_each_chunk(
    llama_pair, monkeypatch
):
    """A causal pass of its own (a compaction's context pass) in paused query chunks goes
    through the CPU flash parts, each chunk over the keys before it and itself (no mask over
    all keys), and equals the plain forward."""
    from cdlm_serve.models import flash_continuation, layers

    _, model = llama_pair
    ids = _ids(40)
    with torch.no_grad():
        whole = model(ids)
        widths: list[int] = []
        real = flash_continuation._FLASH

        def spy(q, k, v, *args, attn_mask=None, **kw):
            widths.append(k.shape[2])
            assert attn_mask is None
            return real(q, k, v, *args, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(flash_continuation, "_FLASH", spy)
        monkeypatch.setattr(layers, "STAGE_ATTENTION_ELEMENTS", 4 * 40 * 8)  # 8 rows a piece
        stages = model.forward_stages(ids)
        try:
            while True:
                next(stages)
        except StopIteration as done:
            staged = done.value
    # Per layer, 5 chunks of 8 rows: the first attends to itself only, the others to what came
    # before (one part) and to themselves (another); no part is wider than 32 keys.
    assert len(widths) == len(model.layers) * 9 and max(widths) == 32
    torch.testing.assert_close(staged, whole, atol=1e-5, rtol=1e-5)


def test_band_visibility_is_what_it_says():
    """A new token of block b sees the sinks, the cached slots within the window of its
    block's aligned slots, the lead, the window of new tokens before its block and its block's
    tokens up to itself: nothing else. Its key ranges say the same."""
    from cdlm_serve.models.attention import Band

    band = Band(window=2, offset=-3, lead=3, sinks=1, rows=4)
    cached, q_len = 12, 10
    seen = band.visible(0, q_len, q_len, cached + q_len, "cpu")
    for i in range(q_len):
        first = i // 4 * 4
        want = {0} | {s for s in range(cached) if first - 3 - 2 <= s < first + 4 - 3 + 2}
        want |= {cached + j for j in range(q_len) if (j < 3 or j >= first - 2) and j <= i}
        assert set(seen[i].nonzero().flatten().tolist()) == want, i
        block = i // 4
        ranges = band.cached_ranges(block, cached) + [
            (cached + a, cached + b) for a, b in band.new_ranges(block, i)
        ]
        listed = {s for a, b in ranges for s in range(a, b)} | {cached + i}
        assert listed == want, i
    assert not bool(seen[5, 8])  # slot 8 is past block 1's aligned slots [1, 5) + 2


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("offset", [-4, 30])  # 30: late blocks' windows fall past the cache
def test_a_banded_continuation_on_a_cpu_equals_the_masked_path_with_the_band(
    llama_pair, monkeypatch, biased, offset
):
    """The CPU flash path of a banded continuation (per block of the band, the key ranges it
    sees, unmasked, and its own rows causally) equals masked SDPA with the band's mask (what
    other devices run), in pieces of the forward that start inside the band's blocks and span
    several; the band changes the result, and a band wider than everything changes nothing."""
    from dataclasses import replace

    from cdlm_serve.models import flash_continuation, layers
    from cdlm_serve.models.attention import Band

    _, model = llama_pair
    real = flash_continuation._FLASH
    ids = _ids(70)
    with torch.no_grad():
        cache = _continued(model, ids[:, :40], 160, biased)
        band = Band(window=5, offset=offset, lead=4, sinks=2, rows=4)
        full = _staged(model, ids[:, 40:], cache, None)
        monkeypatch.setattr(layers, "STAGE_ATTENTION_ELEMENTS", 4 * 70 * 3)  # 3 rows a piece
        small = _staged(model, ids[:, 40:], cache, band)
        monkeypatch.setattr(layers, "STAGE_ATTENTION_ELEMENTS", 4 * 70 * 20)  # 20 > window
        large = _staged(model, ids[:, 40:], cache, band)
        blocks = _staged(model, ids[:, 40:], cache, replace(band, rows=7))
        monkeypatch.setattr(flash_continuation, "_FLASH", None)
        blocks_masked = _staged(model, ids[:, 40:], cache, replace(band, rows=7))
        monkeypatch.setattr(flash_continuation, "_FLASH", real)
        wide = _staged(model, ids[:, 40:], cache, Band(window=200, offset=offset, lead=4))
        monkeypatch.setattr(flash_continuation, "_FLASH", None)  # the masked path
        masked = _staged(model, ids[:, 40:], cache, band)
    torch.testing.assert_close(small, masked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(large, masked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocks, blocks_masked, atol=1e-5, rtol=1e-5)
    assert (blocks - masked).abs().max() > 1e-4  # blocks of 7 see other keys than of 4
    torch.testing.assert_close(wide, full, atol=1e-5, rtol=1e-5)
    assert (masked - full).abs().max() > 1e-3
    assert cache.lengths == [40]


def test_cached_tokens_read_again_get_the_queries_and_states_they_had_at_prefill(
    llama_pair, monkeypatch
):
    """A few of a row's cached tokens run again (`reread`, in small paused pieces) each see
    the slots up to their own, at their own positions: every layer's queries and the final
    states equal the whole causal pass's at those positions, on the CPU flash parts (in
    chunks of a few rows, some of which see nothing past the first one's slot) and on the
    masked path alike, and the cache is left as it was. Seeing every cached slot, they would
    not."""
    from cdlm_serve.models import flash_continuation, layers

    _, model = llama_pair
    ids = _ids(40)
    slots = torch.tensor([0, 3, 17, 18, 39])

    def reread() -> tuple[list[torch.Tensor], torch.Tensor, int]:
        stages = model.forward_stages(ids[:, slots], cache=cache, commit=False, reread=slots)
        items = []
        try:
            while True:
                items.append(next(stages))
        except StopIteration as done:
            return [q for q in items if q is not None], done.value, len(items)

    with torch.no_grad():
        capture = new_capture(model)
        whole = model(ids, capture=capture)  # [1, 40, hidden]
        cache = model.new_cache(1, 128)
        model(ids, cache=cache)
        monkeypatch.setattr(layers, "STAGE_MLP_TOKENS", 2)
        runs = [reread()]
        monkeypatch.setattr(layers, "REREAD_ROWS", 2)  # (0, 3), (17, 18), (39)
        runs.append(reread())
        monkeypatch.setattr(flash_continuation, "_FLASH", None)
        runs.append(reread())
        seeing_all = model(ids[:, slots], cache=cache, positions=slots[None], commit=False)
    assert runs[1][2] > runs[0][2]  # more pieces: the attention in three chunks
    for queries, again, pieces in runs:
        assert len(queries) == len(model.layers) and pieces > 3 * len(model.layers)
        for layer, q in enumerate(queries):
            torch.testing.assert_close(q, capture[layer][0][:, :, slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again, whole[:, slots], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(seeing_all, whole[:, slots], atol=1e-3)
    assert cache.lengths == [40] and cache.logical == [40]
    with pytest.raises(ValueError, match="reread"):
        next(model.forward_stages(ids[:, :2], reread=slots[:2]))


@pytest.fixture(params=ISAS)
def bf16_kernels(request) -> Iterator[None]:
    """The fused attention kernel of each build this CPU runs."""
    with kernel_build(request.param):
        yield


def _softmax_reference(q, k, v, bias, visible) -> torch.Tensor:
    """fp32 attention of q [1, H, R, D] over k, v [1, Hkv, K, D] with bias [1, Hkv, K] and
    visible [R, K] -> [1, H, R, D]."""
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s + bias.repeat_interleave(group, dim=1)[:, :, None, :]
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ vf


@pytest.mark.usefixtures("bf16_kernels")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_packed_attention_kernel_equals_the_softmax_over_what_each_row_sees(head_dim):
    """The fused kernel (`flash_continuation.packed_rows` / `packed_reread`) over a cache
    continuation, plain, banded (rows inside and across the band's blocks) and re-read, with
    a biased cache whose padding slots carry -inf: each row the fp32 softmax over exactly the
    keys it may see, within bf16's rounding, and as close to it as the flash parts are."""
    from cdlm_serve.models import flash_continuation as fc
    from cdlm_serve.models import kernels
    from cdlm_serve.models.attention import Band

    gen = torch.Generator().manual_seed(head_dim)
    cached, new, heads, kv = 150, 45, 6, 2
    total = cached + new
    q = torch.randn(1, heads, new, head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(1, kv, total, head_dim, generator=gen).bfloat16() for _ in range(2))
    bias = torch.zeros(1, kv, total)
    bias[:, :, :cached] = torch.linspace(-2, 1, cached)
    bias[:, :, 7:11] = float("-inf")  # masked padding slots
    scale = head_dim**-0.5
    band = Band(window=20, offset=-4, lead=4, sinks=3, rows=8)
    slots = torch.tensor([0, 3, 12, 60, 61, 149])
    with kernels.cpu_kernels(True):
        assert kernels.packs_attention(q, k)
        packed = kernels.pack_attention(k, v, bias)
        plain = torch.cat(
            [fc.packed_rows(q, packed, scale, 0, 5), fc.packed_rows(q, packed, scale, 5, 45)], 2
        )
        banded = torch.cat(
            [fc.packed_rows(q, packed, scale, a, b, band) for a, b in ((0, 11), (11, 45))], 2
        )
        again = fc.packed_reread(q[:, :, :6], packed, scale, 0, 6, slots)
    rows = torch.arange(new)[:, None]
    causal = torch.arange(total)[None, :] <= cached + rows  # [new, total]
    visible = {
        "plain": causal,
        "banded": band.visible(0, new, new, total, "cpu")[None, None] & causal,
        "reread": torch.arange(total)[None, :] <= slots[:, None],  # each its own prefix
    }
    kh, vh, bh = fc.per_head(k, v, bias, heads, q.dtype)
    flash = {
        "plain": fc.attend_rows(q, kh, vh, bh, scale, 0, new),
        "banded": fc.attend_rows(q, kh, vh, bh, scale, 0, new, band),
        "reread": fc.reread_rows(
            q[:, :, :6],
            kh[:, :, : cached + 6],
            vh[:, :, : cached + 6],
            bh[..., : cached + 6],
            scale,
            0,
            6,
            slots,
        ),
    }
    for name, got in (("plain", plain), ("banded", banded), ("reread", again)):
        rows_q = q[:, :, : got.shape[2]]
        want = _softmax_reference(rows_q, k, v, bias, visible[name])
        error = float((got.float() - want).norm() / want.norm())
        theirs = float((flash[name].float() - want).norm() / want.norm())
        assert error < 6e-3 and error < 2 * theirs + 1e-3, (name, error, theirs)
    assert (banded.float() - plain.float()).abs().max() > 0.05  # the band hides keys


@pytest.mark.usefixtures("bf16_kernels")
def test_a_repeat_pass_through_the_packed_kernel_gives_the_flash_parts_queries(
    tmp_path, monkeypatch
):
    """A bf16 model (head_dim 32) continuing its cache, banded and plain, and re-reading
    cached tokens: every layer's queries and the final states through the fused kernel equal
    the flash parts' within bf16's rounding."""
    from cdlm_serve.models import kernels
    from cdlm_serve.models.attention import Band

    tiny_models.hf_tiny("llama", tmp_path, num_attention_heads=2, num_key_value_heads=1)
    model, _ = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.config.head_dim == 32
    ids = _ids(90)
    band = Band(window=12, offset=-3, lead=3, sinks=2, rows=8)
    calls = []
    real = kernels.attend_packed
    spy = lambda *args, **kw: calls.append(1) or real(*args, **kw)  # noqa: E731
    monkeypatch.setattr(kernels, "attend_packed", spy)

    def run(**how):
        stages = model.forward_stages(
            ids[:, 60:] if "reread" not in how else ids[:, 5:25], cache=cache, commit=False, **how
        )
        queries = []
        try:
            while True:
                if (q := next(stages)) is not None:
                    queries.append(q)
        except StopIteration as done:
            return queries, done.value

    with torch.no_grad():
        cache = model.new_cache(1, 160)
        model(ids[:, :60], cache=cache)
        hows = [{}, {"band": band}, {"reread": torch.arange(5, 25)}]
        with kernels.cpu_kernels(True):
            fused = [run(**how) for how in hows]
        used = len(calls)
        with kernels.cpu_kernels(False):
            parts = [run(**how) for how in hows]
    assert used >= 3 * len(model.layers) and len(calls) == used  # the kernel, then not
    for (qs, out), (qs_ref, out_ref) in zip(fused, parts, strict=True):
        for q, q_ref in zip(qs, qs_ref, strict=True):
            torch.testing.assert_close(q.float(), q_ref.float(), atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(out.float(), out_ref.float(), atol=1e-1, rtol=5e-2)
    assert cache.lengths == [60]
