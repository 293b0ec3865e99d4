"""int8 session caches (engine/compaction/kv_quant.py): the codes' error bound, their stability,
packing, and the files; then a real server's int8 session answering alike from memory, packed, and
after a restart."""

from __future__ import annotations

import httpx
import pytest
import torch

from cdlm_serve.engine.compaction.kv_quant import LEVELS, quantize_prefix
from cdlm_serve.engine.sessions import files as session_files
from cdlm_serve.engine.sessions.packed_cache import PackedCache
from cdlm_serve.models.kv_cache import KVCache
from conftest import tiny_session_server


def _cache(length: int = 40, seed: int = 0, dtype: torch.dtype = torch.float32) -> KVCache:
    """A batch-1, 3-layer, 2-head cache whose first 12 slots carry biases (a compacted
    segment), with outliers in fixed key channels as real keys have."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(3, 1, 2, 16, 64, "cpu", dtype)
    for layer in range(3):
        keys = torch.randn(1, 2, length, 16, generator=gen)
        keys[..., 3] *= 20  # an outlier channel
        cache.keys[layer][:, :, :length] = keys.to(dtype)
        cache.values[layer][:, :, :length] = torch.randn(1, 2, length, 16, generator=gen).to(dtype)
    cache.biases = [torch.zeros(1, 2, 64) for _ in range(3)]
    for bias in cache.biases:
        bias[0, :, :12] = torch.linspace(-3, 1, 12)
    cache.lengths, cache.logical = [length], [100]
    return cache


def test_every_element_is_within_half_a_step_of_its_original():
    cache = _cache()
    before = [cache.read(0, layer) for layer in range(3)]
    before = [(k.clone(), v.clone()) for k, v, _ in before]
    codes = quantize_prefix(cache, 12)
    for layer, (k0, v0) in enumerate(before):
        k1, v1, _ = cache.read(0, layer)
        key_step = k0[:, :12].abs().amax(dim=1, keepdim=True) / LEVELS  # per channel
        value_step = v0[:, :12].abs().amax(dim=2, keepdim=True) / LEVELS  # per token
        assert ((k1[:, :12] - k0[:, :12]).abs() <= key_step / 2 + 1e-6).all()
        assert ((v1[:, :12] - v0[:, :12]).abs() <= value_step / 2 + 1e-6).all()
        assert torch.equal(k1[:, 12:], k0[:, 12:]) and torch.equal(v1[:, 12:], v0[:, 12:])
        assert codes.keys[layer].dtype == torch.int8
    # Per-channel key scales keep the small channels fine despite the outlier channel: the
    # relative error of a small channel is far below one step of the outlier's range.
    k0, _ = before[0]
    k1, _, _ = cache.read(0, 0)
    small = (k1[:, :12, 0] - k0[:, :12, 0]).abs().max() / k0[:, :12, 0].abs().max()
    assert small <= 1 / LEVELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_are_stable_and_packing_is_lossless(dtype):
    cache = _cache(dtype=dtype)
    codes = quantize_prefix(cache, 12)
    snapshot = [t.clone() for t in cache.keys + cache.values]
    again = quantize_prefix(cache, 12)  # re-quantizing the dequantized values changes nothing
    for a, b in zip(codes.keys + codes.values, again.keys + again.values, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(snapshot, cache.keys + cache.values, strict=True):
        assert torch.equal(a, b)
    packed = PackedCache.pack(cache, codes)
    dense_prefix = 2 * 3 * 2 * 12 * 16 * dtype.itemsize  # K and V of the 12 slots
    # int8 codes, plus scales that are a large share at this tiny head size (16 channels)
    assert codes.nbytes() <= (0.33 if dtype == torch.float32 else 0.66) * dense_prefix
    assert packed.nbytes() == cache.nbytes(0) - dense_prefix + codes.nbytes()
    back, back_codes = packed.unpack()
    assert back_codes is not None and torch.equal(back_codes.values[2], codes.values[2])
    assert (back.lengths, back.logical) == (cache.lengths, cache.logical)
    for layer in range(3):
        for got, want in zip(back.read(0, layer), cache.read(0, layer), strict=True):
            assert torch.equal(got, want)


def test_a_quantized_segment_goes_to_disk_as_codes_and_comes_back_alike(tmp_path):
    cache = _cache()
    codes = quantize_prefix(cache, 12)

    def version(sid: str) -> session_files.Version:
        return session_files.Version(sid, "m", list(range(100)), None, [], 0.0, 0, 0, 0, [])

    plain = session_files.write_version(tmp_path / "plain", version("plain"), cache, 0)
    packed = session_files.write_version(tmp_path / "int8", version("int8"), cache, 0, codes)
    assert [(s.start, s.end) for s in packed.segments] == [(0, 12), (12, 40)]
    assert packed.disk_bytes < plain.disk_bytes
    back, back_codes = session_files.read_cache(
        tmp_path / "int8",
        session_files.recover(tmp_path / "int8"),
        torch.device("cpu"),
        torch.float32,
    )
    assert back_codes is not None and torch.equal(back_codes.keys[1], codes.keys[1])
    for layer in range(3):
        for got, want in zip(back.read(0, layer), cache.read(0, layer), strict=True):
            assert torch.equal(got, want)
    # An append writes only its own slots, plain; the codes' segment stays as it is.
    grown = _cache(44)
    restore_prefix(grown, codes)
    appended = session_files.write_version(tmp_path / "int8", packed, grown, 40, codes)
    assert appended.segments[0] == packed.segments[0] and appended.segments[-1].start == 40


def restore_prefix(cache: KVCache, codes) -> None:
    from cdlm_serve.engine.compaction.kv_quant import restore

    restore(cache, codes)


CONTEXT = "The code name of the blue box is Orchid-417. The red jar holds Falcon-233. " * 3


def _peek(base: str, sid: str) -> str:
    r = httpx.post(
        f"{base}/v1/completions",
        json={
            "model": "tiny",
            "session_id": sid,
            "prompt": "\nQ:",
            "max_tokens": 12,
            "temperature": 0,
            "append": False,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_int8_session_answers_alike_in_memory_packed_and_after_a_restart(
    tiny_llama_dir, tmp_path
):
    body = {"ratio": 4, "method": "am-highest", "keep_recent": 16}
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:
        for sid in ("plain", "int8"):
            created = httpx.post(
                f"{url}/v1/sessions", json={"model": "tiny", "id": sid, "prompt": CONTEXT}
            )
            assert created.status_code == 201
        plain = httpx.post(f"{url}/v1/sessions/plain/compact", json=body, timeout=300).json()
        quantized = httpx.post(
            f"{url}/v1/sessions/int8/compact", json=body | {"quantize": "int8"}, timeout=300
        ).json()
        assert quantized["quantized"] == "int8" and plain["quantized"] is None
        info = quantized["session"]
        assert info["quantized_tokens"] == quantized["target"]
        assert info["physical_tokens"] == plain["session"]["physical_tokens"]
        # Smaller on disk and, idle, in memory (packed as codes after the compaction).
        assert info["disk_bytes"] < plain["session"]["disk_bytes"]
        assert info["bytes"] < plain["session"]["bytes"]
        first = _peek(url, "int8")  # unpacked for the request, packed again after it
        assert _peek(url, "int8") == first
        assert httpx.get(f"{url}/v1/sessions/int8").json()["bytes"] == info["bytes"]
    with tiny_session_server(tiny_llama_dir, tmp_path) as url:  # from the int8 files
        assert _peek(url, "int8") == first
        again = httpx.get(f"{url}/v1/sessions/int8").json()
        assert again["quantized_tokens"] == quantized["target"]
