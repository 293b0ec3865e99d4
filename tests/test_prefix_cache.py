"""Automatic prefix caching (engine.decoding.prefix_cache) in the AR engine, on a tiny model: keys
name whole prefixes, a cached prefix is loaded instead of prefilled, and the answers (greedy tokens
and their logprobs) are those of the same engine without the cache, under concurrency, chunked
prefill and eviction pressure."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache, block_hashes
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.loading import load_model
from tolerances import tolerance


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' tiny Llama and ours, loaded from its checkpoint."""
    folder = tmp_path_factory.mktemp("llama")
    hf = tiny_models.hf_tiny("llama", folder)
    ours, _ = load_model(folder)
    return hf, ours


@pytest.fixture(scope="module")
def model(pair):
    return pair[1]


def _transformers_answer(hf, prompt: list[int], answer: list[int]) -> tuple[list[int], list[float]]:
    """What transformers' own forward says of an answer, in one pass over the prompt and the
    answer (no cache, no chunks: none of the engine's code): the greedy token at each answer
    position and its logprob."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1 :]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.argmax(-1).tolist(), logp.max(-1).values.tolist()


def test_block_keys_name_the_whole_prefix():
    a = list(range(40))
    b = [*range(16), 99, *range(17, 40)]  # differs in block 1 only
    ka, kb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ka) == 2  # full blocks only: 8 tokens are left over
    assert ka[0] == kb[0] and ka[1] != kb[1]
    c = [1, *range(1, 40)]  # differs in block 0: every later key differs too
    assert all(x != y for x, y in zip(ka, block_hashes(c, 16), strict=True))
    assert block_hashes(list(range(32)), 16) == ka  # a key depends on its prefix alone


def _bytes_per_block(model, block: int) -> int:
    cfg = model.config
    per_slot = KVCache.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return per_slot * block


def _run_all(engine: AREngine, prompts: list[list[int]], waves: int) -> dict[str, tuple]:
    """Run the prompts in `waves` groups (a wave joins while the previous one decodes) and
    return, per request, (tokens, logprobs, cached prompt tokens)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    per_wave = -(-len(seqs) // waves)
    got: dict[str, tuple[list[int], list[float], int]] = {}
    pending = [seqs[i : i + per_wave] for i in range(0, len(seqs), per_wave)]
    step = 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:
            for seq in pending.pop(0):
                engine.add(seq)
        for out in engine.step():
            tokens, lps, _ = got.setdefault(out.request_id, ([], [], 0))
            tokens.extend(out.token_ids)
            lps.extend(lp.logprob for lp in out.logprobs)
            if out.finish_reason is not None:
                got[out.request_id] = (tokens, lps, out.cached_tokens or 0)
        step += 1
    return got


def test_answers_are_the_same_with_and_without_the_cache(pair):
    """A shared 70-token system prompt and distinct questions, 12 requests in 3 waves on 4 rows,
    prompts prefilled in 32-token chunks, a cache that holds 6 blocks (the prompts offer ~30):
    every answer and logprob equals the uncached engine's, and later requests hit. Both are
    transformers' greedy answer with its logprobs (from one full forward each): the engine's
    shared code is checked too, not only the cache against its absence."""
    hf, model = pair
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, 256, (70,), generator=gen).tolist()
    prompts = [
        system + torch.randint(0, 256, (5 + 7 * (i % 4),), generator=gen).tolist()
        for i in range(12)
    ]
    prompts.append(list(prompts[3]))  # the very same prompt again: all but its last token hit
    plain = AREngine(model, tiny_models.byte_tokenizer(), 512, max_batch=4, prefill_tokens=32)
    cache = PrefixCache(6 * _bytes_per_block(model, 16))
    cached = AREngine(
        model, tiny_models.byte_tokenizer(), 512, max_batch=4, prefill_tokens=32, prefix_cache=cache
    )
    want = _run_all(plain, prompts, waves=3)
    got = _run_all(cached, prompts, waves=3)
    assert set(got) == set(want)
    for rid, (tokens, lps, _) in want.items():
        assert got[rid][0] == tokens, rid
        # fp32 attention over the same keys, summed in another order (cached vs computed rows)
        assert (
            max(abs(a - b) for a, b in zip(got[rid][1], lps, strict=True))
            <= tolerance(torch.float32, 100) * 10
        ), rid
        assert want[rid][2] == 0
        # The same prompt and answer through transformers alone.
        ref_tokens, ref_lps = _transformers_answer(hf, prompts[int(rid[1:])], tokens)
        assert tokens == ref_tokens, rid
        assert (
            max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True))
            <= tolerance(torch.float32, 100) * 10
        ), rid
    hit = {rid: c for rid, (_, _, c) in got.items()}
    assert hit["r0"] == 0  # the first wave found nothing
    assert all(c % 16 == 0 and c <= len(prompts[int(r[1:])]) - 1 for r, c in hit.items())
    assert sum(1 for c in hit.values() if c >= 64) >= 6  # later waves reuse the system prompt
    assert cache.hits == sum(hit.values()) and cache.queries == sum(map(len, prompts))
    assert cache.nbytes <= cache.capacity_bytes and len(cache) == 6  # evicted down to budget


def test_an_exact_repeat_reuses_its_answer_blocks_in_the_next_turn(model):
    """A chat's next turn (prompt + answer + a new message) finds the first turn's prompt and
    answer blocks: only the tail after the last full block is prefilled."""
    cache = PrefixCache(1 << 24)
    engine = AREngine(model, tiny_models.byte_tokenizer(), 512, prefix_cache=cache)
    first = list(range(40, 104))  # 64 tokens: 4 full blocks
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = list(engine.generate(first, params))
    answer = [t for o in outs for t in o.token_ids]
    # The same prompt again: its last token must run (its logits are the first answer token),
    # so the block holding it is prefilled again.
    again = list(engine.generate(first, params))
    assert again[-1].cached_tokens == 48 and [t for o in again for t in o.token_ids] == answer
    turn = first + answer + [5, 6, 7]  # 97 tokens; the answer's last token never ran
    outs = list(engine.generate(turn, params))
    # Slots holding first + answer[:-1] (93 tokens) were kept: 5 full blocks = 80 tokens.
    assert outs[-1].cached_tokens == 80
    plain = AREngine(model, tiny_models.byte_tokenizer(), 512)
    again = [t for o in plain.generate(turn, params) for t in o.token_ids]
    assert [t for o in outs for t in o.token_ids] == again


def test_a_cache_of_zero_bytes_keeps_nothing(model):
    cache = PrefixCache(0)
    engine = AREngine(model, tiny_models.byte_tokenizer(), 512, prefix_cache=cache)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        outs = list(engine.generate(list(range(60)), params))
        assert outs[-1].cached_tokens == 0
    assert len(cache) == 0 and cache.hits == 0 and cache.queries == 120


def test_eviction_takes_the_least_recently_used_leaves_first():
    """Under pressure a chain loses its deepest blocks first, so what stays is a usable
    prefix; a chain just matched outlives one matched earlier."""
    block = 4
    cache = KVCache.allocate(2, 1, 1, 8, 64, "cpu", torch.float32)
    for layer in range(2):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    cache.lengths[0] = cache.logical[0] = 64
    one = 2 * 2 * 1 * block * 8 * 4  # bytes of one block: L * (K, V) * Hkv * block * D * fp32
    pc = PrefixCache(6 * one, block)
    # 3, 3 and 2 full blocks, and a last token (never matched: it must run)
    a, b, c = [*range(12), 0], [*range(100, 112), 0], [*range(200, 208), 0]
    pc.insert(a, cache, 0)
    pc.insert(b, cache, 0)
    pc.match(a)  # a is the most recently used chain now
    pc.insert(c, cache, 0)  # 8 blocks, 6 fit: the older chain, b, loses its 2 deepest
    assert len(pc) == 6
    assert [len(pc.match(x)) for x in (a, b, c)] == [3, 1, 2]
    found = pc.match(a)
    assert torch.equal(found[1][:, 0], torch.stack([k[0, :, 4:8] for k in cache.keys]))
    assert torch.equal(found[1][:, 1], torch.stack([v[0, :, 4:8] for v in cache.values]))


def test_a_salt_keeps_requests_from_sharing_blocks(model):
    """vLLM's cache_salt: a prompt cached under one salt is a miss under another salt and
    without one, and a hit under the same salt again."""
    cache = PrefixCache(1 << 24)
    engine = AREngine(model, tiny_models.byte_tokenizer(), 512, prefix_cache=cache)
    prompt = list(range(40, 90))  # 3 full blocks before the last token

    def cached(salt: str | None) -> int:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_salt=salt)
        return list(engine.generate(prompt, params))[-1].cached_tokens

    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-a")] == [
        0,
        0,
        0,
        48,
    ]
    assert cached(None) == 48  # the unsalted run above is cached under no salt
