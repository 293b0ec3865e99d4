"""The fused CPU decode kernels against their PyTorch references (bf16), every test on each
build this CPU runs (AVX2 everywhere in CI, AVX512-BF16 and AMX where the CPU has them)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_default_build_root

import tiny_models
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.quantize import quantize_q8_0
from cpu_features import ISAS, kernel_build, skip_unless

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True, params=ISAS)
def isa(request):
    """Each test on each build."""
    with kernel_build(request.param):
        yield request.param


@contextmanager
def kernels_run():
    """The kernels run inside, counted (a comparison where they never ran would compare the
    reference with itself)."""
    isa, before = kernels.active_isa(), kernels._kernel.calls()
    yield
    assert kernels.active_isa() == isa and kernels._kernel.calls() > before, (
        f"the {isa} kernels did not run"
    )


KERNELS_ON = [False]  # inside both(): whether this call of fn runs with the kernels on


def both(fn):
    """fn() with the kernels on, then with the PyTorch references."""
    with kernels.cpu_kernels(True), kernels_run():
        KERNELS_ON[0] = True
        try:
            fast = fn()
        finally:
            KERNELS_ON[0] = False
    with kernels.cpu_kernels(False):
        ref = fn()
    return fast, ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (200, 576), (7, 40), (33, 70)])
def test_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16)
    with torch.inference_mode():
        fast, _ = both(lambda: kernels.linear(x, w, b))
    exact = x.float() @ w.float().T + b.float()
    # fp32 accumulation, one bf16 rounding at the end: within bf16's relative precision.
    assert _rel(fast, exact) <= 1e-2


@pytest.fixture(params=[False, True], ids=["vectors", "amx"])
def amx(request, isa):
    """Each packed-linear test on vector registers and, where this build, CPU and OS allow
    it, on AMX tiles."""
    if request.param and isa != "avx512":
        pytest.skip("AMX tiles are the AVX512 build's")
    active = kernels.use_amx(request.param)
    if request.param:
        skip_unless("amx-bf16", active, "the AMX tile matmuls")
    yield active
    kernels.use_amx(True)  # the default


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (200, 576), (7, 40), (3 * 16 * 3 + 5, 128)])
def test_packed_linear_matches_row_kernel(rows, n, k, amx):
    """The decode stack's packed weights (tiles of 16 outputs, k in pairs; N not a multiple of
    16 or of the tile group) give the same products as the row-major kernel. On AMX, k = 40 is
    not a whole number of 32-wide tiles and takes the AVX512 path."""
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16)
    packed = kernels._kernel.pack_bf16(w)
    assert packed.shape == ((n + 15) // 16, k // 2, 16)
    got = kernels._kernel.linear_packed_bf16(x, packed, n, b)
    exact = x.float() @ w.float().T + b.float()
    assert _rel(got, exact) <= 1e-2
    assert _rel(got, kernels._kernel.linear_bf16(x, w, b)) <= 1e-2
    unbiased = kernels._kernel.linear_packed_bf16(x, packed, n, None)
    assert _rel(unbiased, x.float() @ w.float().T) <= 1e-2


@pytest.mark.parametrize("rows", [9, 16, 17, 33, 40])
def test_packed_linear_takes_any_number_of_rows(rows, amx):
    """A prompt's tokens go through the packed weights too: AMX takes 16 rows per tile (17 and
    40 are padded to whole tiles), AVX512 chunks of 8 rows (AVX2 of 3) within each group of
    weight tiles (the group read from memory once for all the chunks). Each row's sums run in
    the same order as alone, so the rows of one call equal calls of at most 8 rows bit for
    bit."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    w = torch.randn(3 * 16 * 2 + 7, 576, generator=gen).to(BF16)
    b = torch.randn(w.shape[0], generator=gen).to(BF16)
    packed = kernels._kernel.pack_bf16(w)
    got = kernels._kernel.linear_packed_bf16(x, packed, w.shape[0], b)
    assert got.shape == (rows, w.shape[0])
    assert _rel(got, x.float() @ w.float().T + b.float()) <= 1e-2
    if not amx:
        apart = [
            kernels._kernel.linear_packed_bf16(x[m : m + 8].contiguous(), packed, w.shape[0], b)
            for m in range(0, rows, 8)
        ]
        assert torch.equal(got, torch.cat(apart))


def _within_an_ulp(fast: torch.Tensor, ref: torch.Tensor) -> bool:
    """Every element of two bf16 results at most one bf16 step apart (the same rounding order;
    the fp32 sums may differ in their last bits)."""
    step = ref.float().abs() * 2.0**-7 + 1e-6
    return bool(((fast.float() - ref.float()).abs() <= step).all())


# A decode step's rows, and a prefill's (2 x 203 rows: over the kernels' 64-row grain, so they
# are split over the threads, with a short last range).
@pytest.mark.parametrize("shape", [(3, 576), (2, 203, 576)])
def test_norms_and_activation(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(BF16)
    r = torch.randn(*shape, generator=gen).to(BF16)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(BF16)
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.rms_norm(x, w, 1e-5))
        assert fast.shape == x.shape and _within_an_ulp(fast, ref)
        (fn, fs), (rn, rs) = both(lambda: kernels.add_rms_norm(x, r, w, 1e-5))
        assert torch.equal(fs, rs)  # the residual sum rounds exactly like x + r
        assert _within_an_ulp(fn, rn)
        gu = torch.randn(2, 2 * 96, generator=gen).to(BF16)
        fast, ref = both(lambda: kernels.silu_mul(gu))
        assert fast.shape == (2, 96) and _rel(fast, ref) <= 1e-2


def test_rotary():
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 3, 5 * 64, generator=gen).to(BF16)
    cos = torch.randn(3, 1, 64, generator=gen).to(BF16)
    sin = torch.randn(3, 1, 64, generator=gen).to(BF16)
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.rotate_qk(qkv.clone(), cos, sin, 4, 64))
    assert _rel(fast, ref) <= 1e-2
    assert torch.equal(fast[..., 4 * 64 :], qkv[..., 4 * 64 :])  # v is left alone


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_attention(with_bias, dim):
    """Keys in blocks of 16 with a tail (17, 40), exactly one block (16), a single key (1)."""
    gen = torch.Generator().manual_seed(2)
    batch, heads, kv_heads, slots = 4, 6, 2, 40
    q = torch.randn(batch, heads, dim, generator=gen).to(BF16)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(BF16)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(BF16)
    bias = torch.randn(batch, kv_heads, slots, generator=gen) if with_bias else None
    lengths = [17, 40, 16, 1]
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.decode_attention(q, keys, values, lengths, 0.125, bias))
    assert fast.shape == (batch, heads * dim) and _rel(fast, ref) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_argmax_matches_torch(dtype):
    x = torch.randn(5, 49155, generator=torch.Generator().manual_seed(3))  # a 3-wide tail
    x[1, 100] = x[1, 200] = 1e6  # ties resolve to the first index
    x[2, 117] = x[2, 101] = 1e6  # ... across lanes too (101 is lane 5, 117 lane 5 one step on)
    x[3, 49154] = 1e6  # the maximum in the tail
    x[4, 49153] = x[4, 7] = 1e6  # a tie between the vector part and the tail
    x = x.to(dtype)
    fast, ref = both(lambda: kernels.argmax(x))
    assert torch.equal(fast, x.float().argmax(-1)) and torch.equal(ref, fast)
    assert fast[1:].tolist() == [100, 101, 49154, 7]


def test_silu_over_the_whole_range():
    """The kernel's own exp: silu(g) * u from -100 to 100 (exp clamps, no inf/NaN)."""
    g = torch.linspace(-100, 100, 4001)
    gu = torch.cat([g, torch.ones_like(g)]).view(1, -1).to(BF16)
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.silu_mul(gu))
    assert torch.isfinite(fast.float()).all()
    assert ((fast.float() - ref.float()).abs() <= 1e-2 * ref.float().abs() + 1e-6).all()


def test_gelu_gate_over_the_whole_range():
    """Gemma's GeGLU, gelu_tanh(g) * u, from -100 to 100 (the kernel's tanh through its exp:
    no inf/NaN at either end) and on random rows with a tail of 3 past the vectors."""
    g = torch.linspace(-100, 100, 4003)
    gu = torch.cat([g, torch.linspace(-2, 2, 4003)]).view(1, -1).to(BF16)
    rows = torch.randn(3, 2 * 99, generator=torch.Generator().manual_seed(4)).to(BF16)
    with torch.inference_mode():
        for x in (gu, rows):
            fast, ref = both(lambda x=x: kernels.gelu_mul(x))
            assert fast.shape == ref.shape and torch.isfinite(fast.float()).all()
            err = (fast.float() - ref.float()).abs()
            assert (err <= 1e-2 * ref.float().abs() + 1e-2).all(), err.max()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny bf16 Gemma 3 (head_dim 32): sandwich norms, GELU, q/k norms, a window of 8 on
    layers 0 and 2 with their own RoPE base."""
    folder = tmp_path_factory.mktemp("bf16-gemma")
    tiny_models.hf_tiny("gemma3", folder, head_dim=32)
    return load_model(folder, dtype=BF16)[0], load_model(folder, dtype=torch.float32)[0]


def test_gemma_decodes_through_the_fused_step_with_its_window_rings(gemma):
    """Gemma 3's decode steps take the fused step (`forward_windowed`: the window layers' rings,
    their window as a bias, their RoPE): two rows of different lengths, 14 steps past the
    window of 8 (the rings wrapped), give logits as close to the fp32 model's as the bf16
    PyTorch path's are (2% of their norm here: bf16's rounding, through 3 layers and 14 steps),
    and write the same K/V into the rings and the global cache, to bf16 rounding. Prompts still
    take PyTorch's."""
    model, exact_model = gemma
    model._decode_stack = None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 11)]
    steps = torch.randint(0, 256, (2, 14), generator=gen).tolist()
    calls = []

    def run(model=model):
        runner, cache = ModelRunner(model), model.new_cache(2, 8)
        with torch.inference_mode():
            runner.extend([(0, prompts[0]), (1, prompts[1])], cache)
            out = []
            for i in range(14):
                before = kernels._kernel.calls() if kernels._kernel else 0
                hidden = runner.extend([(0, [steps[0][i]]), (1, [steps[1][i]])], cache)
                calls.append(kernels._kernel.calls() - before if kernels._kernel else 0)
                out.append(model.logits(hidden).float())
        assert cache.logical == [34, 25] and cache.window.ring >= 8  # (grown for the prompts)
        return torch.stack(out), cache

    (got, cache), (ref, ref_cache) = both(run)
    assert calls[:14] == [1] * 14 and calls[14:] == [0] * 14  # one fused call a step, then none
    with kernels.cpu_kernels(False):
        exact, _ = run(exact_model)

    def error(x: torch.Tensor) -> float:
        return float((x - exact).norm() / exact.norm())

    assert error(got) <= 1.25 * error(ref) + 1e-3, (error(got), error(ref))
    for ours, theirs in (
        *zip(
            cache.window.keys + cache.window.values,
            ref_cache.window.keys + ref_cache.window.values,
            strict=True,
        ),
        *zip(cache.keys + cache.values, ref_cache.keys + ref_cache.values, strict=True),
    ):
        assert (ours.float() - theirs.float()).abs().max() <= 0.05 * theirs.float().abs().max()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny bf16 Llama with head_dim 64, so every fused op applies."""
    folder = tmp_path_factory.mktemp("bf16-llama")
    tiny_models.kernel_llama(folder)
    return load_model(folder, dtype=BF16)[0]


def _decode(runner: ModelRunner, cache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step of every row through the runner (the engines' path): tokens [B] ->
    logits [B, V]; the fused step where the kernels are on, PyTorch where they are off (said
    here: the op-level kernels alone also make the two paths' numbers differ)."""
    fused = runner.stack() is not None
    assert fused == KERNELS_ON[0], "the runner chose the wrong path"
    chunks = [(row, [int(t)]) for row, t in enumerate(tokens)]
    return runner.model.logits(runner.extend(chunks, cache))


def test_bf16_decoding_with_and_without_kernels_agrees(model):
    """Whole-model check: prefill + 12 decode steps in bf16, fused vs PyTorch path."""
    ids = torch.randint(0, tiny_models.VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    runner = ModelRunner(model)

    def run():
        cache = model.new_cache(2, 64)
        with torch.inference_mode():
            outs = [model.logits(model(ids[:, :8], cache=cache))[:, -1]]
            outs += [_decode(runner, cache, ids[:, i]) for i in range(8, 20)]
        return torch.stack(outs, 1).float()

    fast, ref = both(run)
    assert not torch.equal(fast, ref)  # the fused path really ran (it rounds differently)
    assert _rel(fast, ref) <= 3e-2
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_fused_decode_honours_compacted_segments(model):
    """A cache whose prefix was replaced by a smaller biased segment: the fused step must add
    beta per key and continue from the logical length, like the reference path."""
    ids = torch.randint(0, tiny_models.VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    runner = ModelRunner(model)

    def run():
        cache = model.new_cache(1, 64)
        with torch.inference_mode():
            model(ids[:, :16], cache=cache)
            segs = [cache.read(0, layer) for layer in range(model.config.num_layers)]
            keep = torch.arange(0, 16, 2)  # every other slot, reweighted
            cache.replace_prefix(
                0,
                16,
                [k[:, keep].clone() for k, _, _ in segs],
                [v[:, keep].clone() for _, v, _ in segs],
                [
                    torch.randn(k.shape[0], len(keep), generator=torch.Generator().manual_seed(7))
                    for k, _, _ in segs
                ],
            )
            assert cache.lengths == [8] and cache.logical == [16]
            outs = [_decode(runner, cache, ids[:, i]) for i in range(16, 24)]
        return torch.stack(outs, 1).float()

    fast, ref = both(run)
    assert not torch.equal(fast, ref)
    assert _rel(fast, ref) <= 3e-2


def test_decode_of_more_rows_than_one_kernel_pass(model):
    """`--max-batch` above 8: the fused step takes any number of rows (8 per AVX512 pass, 16
    per AMX tile), with the same results as the PyTorch path."""
    rows = kernels.MAX_KERNEL_ROWS + 2
    ids = torch.randint(0, tiny_models.VOCAB, (rows, 9), generator=torch.Generator().manual_seed(6))
    runner = ModelRunner(model)

    def run():
        cache = model.new_cache(rows, 32)
        with torch.inference_mode():
            model(ids[:, :8], cache=cache)
            return _decode(runner, cache, ids[:, 8]).float()

    fast, ref = both(run)
    assert fast.shape == (rows, tiny_models.VOCAB)
    assert not torch.equal(fast, ref)  # the fused path really ran
    assert _rel(fast, ref) <= 3e-2


@pytest.fixture(params=["rows", "packed", "packed-amx"])
def stack_kind(request, model, monkeypatch, isa):
    """The model's decode stack rebuilt on each matmul path: weights as they are (row kernel,
    CDLM_SERVE_PACKED=0), packed on vector registers, packed on AMX tiles (where available)."""
    monkeypatch.setenv("CDLM_SERVE_PACKED", "0" if request.param == "rows" else "1")
    amx = request.param == "packed-amx"
    if amx and isa != "avx512":
        pytest.skip("AMX tiles are the AVX512 build's")
    if kernels.use_amx(amx) != amx:
        skip_unless("amx-bf16", False, "the AMX tile matmuls")
    model._decode_stack = None  # rebuilt by the next step, on this path
    yield request.param
    kernels.use_amx(True)
    model._decode_stack = None


def test_fused_step_mixes_decode_rows_and_prompts(model, stack_kind):
    """One fused call decodes two rows (one continuing a compacted, biased segment) and
    prefills a 7-token prompt into a third; then all three decode once more. Every logit and
    the cache bookkeeping match running each row alone through the PyTorch path."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, tiny_models.VOCAB, (3, 12), generator=gen).tolist()
    beta = [torch.randn(1, 4, generator=gen) for _ in range(model.config.num_layers)]

    def prepared():
        cache = model.new_cache(3, 16)  # too small: the step must grow it
        with kernels.cpu_kernels(False), torch.inference_mode():
            for row in (0, 1):
                view = cache.rows(row, row + 1)
                model(torch.tensor([ids[row][:8]]), cache=view)
                cache.merge_view(view, row)
            segs = [cache.read(1, layer) for layer in range(model.config.num_layers)]
            keep = torch.tensor([0, 3, 5, 7])
            cache.replace_prefix(
                1,
                8,
                [k[:, keep].clone() for k, _, _ in segs],
                [v[:, keep].clone() for _, v, _ in segs],
                beta,
            )
        return cache

    def alone(cache, row, tokens):
        view = cache.rows(row, row + 1)
        hidden = model(torch.tensor([tokens]), cache=view)[:, -1]
        cache.merge_view(view, row)
        return hidden

    steps = [
        [(0, [ids[0][8]]), (1, [ids[1][8]]), (2, ids[2][:7])],
        [(0, [ids[0][9]]), (1, [ids[1][9]]), (2, [ids[2][7]])],
    ]
    with torch.inference_mode():
        cache = prepared()
        runner = ModelRunner(model)
        stack = runner.stack()
        assert stack is not None
        fused = [model.logits(runner.fused_step(stack, c, cache)).float() for c in steps]
        fused_lengths = (cache.lengths, cache.logical)
        cache = prepared()
        with kernels.cpu_kernels(False):
            ref = [
                model.logits(torch.cat([alone(cache, r, t) for r, t in chunks])).float()
                for chunks in steps
            ]
    assert fused_lengths == (cache.lengths, cache.logical) == ([10, 6, 8], [10, 10, 8])
    for got, want in zip(fused, ref, strict=True):
        assert got.shape == (3, tiny_models.VOCAB)
        assert _rel(got, want) <= 3e-2
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("values", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("queries", "keys", "region"),
    [(1, 7, 7), (3, 83, 70), (37, 200, 131), (130, 1000, 992), (257, 64, 64), (9, 48, 40)],
)
def test_repeat_max_is_the_softmax_maxima(queries, keys, region, values):
    """KVzip's running log maxima from the kernel against float64 on the same numbers: rows
    and regions shorter than a vector, a region short of the row, blocks of 128 queries and a
    short last one (over the threads), 8-query passes and a short one, key tiles of 16 in
    groups of 3 and a short group (bf16 values: AVX512-BF16 dot products on that build), a
    slot whose exp is far under fp32's range, scores far apart (each query's softmax mostly
    one key), and a running maximum that beats some of the new maxima."""
    gen = torch.Generator().manual_seed(queries * keys)
    q = torch.randn(queries, 64, generator=gen) * 2
    k = torch.randn(keys, 64, generator=gen)
    if values == "bf16":  # bf16 values held in fp32, as the compaction's keys
        q, k = q.to(BF16), k.to(BF16).float()
    bias = torch.randn(keys, generator=gen)
    bias[-1] = -1e4  # adds nothing to any normalizer
    best = torch.log(torch.rand(region, generator=gen)) - 4  # the maxima of earlier blocks
    s = (q.double() @ k.double().T) * 0.3 + bias.double()
    exact = torch.maximum(best.double(), torch.log_softmax(s, 1)[:, :region].amax(0))
    assert (best > exact.float() - 1e-3).any() and (best < exact.float() - 1).any()
    out = best.clone()
    with kernels.cpu_kernels(True), kernels_run():
        assert kernels.repeat_max(q, k, bias, 0.3, region, out)
    assert torch.allclose(out.double(), exact, atol=3e-5, rtol=0)
    with kernels.cpu_kernels(False):  # the caller's torch path then
        assert not kernels.repeat_max(q, k, bias, 0.3, region, out)


@pytest.mark.parametrize("rows", [2, 32, 100])
def test_fp32_split_linear_is_exact(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(131, 96, generator=gen)  # N not divisible by the thread count
    b = torch.randn(131, generator=gen)
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.linear(x, w, b))
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("decoding", "shipped"),
    [("cdlm", "cdlm-student"), ("fast_dllm", "cdlm-teacher"), ("vanilla", "cdlm-teacher")],
)
def test_fused_dlm_steps_decode_like_the_pytorch_path(decoding, shipped):
    """A shipped model in bf16 (the server's CPU default), 8 (4) held-out traces decoded two at a
    time (so that every step fits FUSED_STEP_TOKENS; B = 8, tau 0.9): the fused step gives
    the PyTorch path's logits, answers and step counts in every decoding mode: cdlm (each
    row's blocks bidirectional within themselves, block-causal to the committed slots),
    fast_dllm (the block and every later position bidirectional over the refreshed prefix
    cache) and vanilla (the whole sequence through a scratch cache)."""
    from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
    from cdlm_serve.models.sources import resolve
    from cdlm_serve.train.data import KINDS
    from cdlm_serve.train.tasks import TASKS, exact_match
    from cdlm_serve.train.tokenizer import byte_tokenizer

    model = load_model(resolve(shipped), dtype=BF16)[0]
    # 8 problems (4 for vanilla, whose every step runs the whole sequence: 38 s for 8).
    problems = TASKS["trace4"].held_out()[: 4 if decoding == "vanilla" else 8]
    fused_calls = []
    real = ModelRunner.fused_tokens

    def counted(self, *args, **kwargs):
        fused_calls.append(self.model is model)
        return real(self, *args, **kwargs)

    def run():
        fused_calls.clear()
        engine = DLMEngine(model, byte_tokenizer(), model.config.max_position_embeddings, 2)
        # Each step's state (the sequence's answer before the step) and its block logits.
        seen: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        engine.on_step = lambda seq, logits: seen.__setitem__(
            (seq.id, seq.steps), (seq.answer.clone(), logits.clone())
        )
        params = DLMParams(max_tokens=KINDS["trace4"].answer_len, decoding=decoding, block_size=8)
        for i, ex in enumerate(problems):
            engine.add(engine.new_sequence(str(i), list(ex.prompt.encode()), params))
        text, steps = [""] * len(problems), [0] * len(problems)
        while engine.has_work():
            for out in engine.step():
                text[int(out.request_id)] += out.text
                steps[int(out.request_id)] = out.steps
        return text, steps, list(fused_calls), engine.forward_passes, seen

    ModelRunner.fused_tokens = counted  # every engine's runner counts its fused passes
    try:
        (
            (fast, fast_steps, fast_calls, passes, fast_seen),
            (ref, ref_steps, ref_calls, _, ref_seen),
        ) = both(run)
    finally:
        ModelRunner.fused_tokens = real
    # Wherever both paths reached the same state, their logits agree to bf16 rounding.
    same = [k for k in fast_seen if k in ref_seen and torch.equal(fast_seen[k][0], ref_seen[k][0])]
    assert len(same) >= len(ref_seen) // 2, (len(same), len(ref_seen))
    for k in same:
        err = _rel(fast_seen[k][1], ref_seen[k][1])
        assert err < 0.05, (k, err)  # a token hidden from the others: 0.5
    # Every step ran fused with the kernels on (cdlm's prompt prefills, one per admission, run
    # through PyTorch), none without: the runner decides, nothing is tried and fallen back from.
    assert all(fast_calls) and len(fast_calls) >= passes - len(problems), (len(fast_calls), passes)
    assert not ref_calls
    pairs = list(zip(fast, ref, strict=True))
    # All but one answer alike (a near-tied bf16 logit may flip one), all but two right.
    assert sum(a == b for a, b in pairs) >= len(problems) - 1, pairs
    assert abs(sum(fast_steps) - sum(ref_steps)) <= 2
    right = sum(exact_match(t, ex.answer) for t, ex in zip(fast, problems, strict=True))
    assert right >= len(problems) - 2


@pytest.mark.parametrize("dim", [64, 128])
def test_decode_attention_over_the_padding_of_uneven_budgets(dim):
    """Each head's compacted segment padded to the longest head's (a -inf bias:
    engine/sessions/ragged.py), then recent slots: the kernel skips the padding (whole blocks of 16
    and single keys) and answers exactly as if the padding were read (its probability is 0),
    matching the reference."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, slots, segment = 3, 6, 3, 90, 70
    q = torch.randn(batch, heads, dim, generator=gen).to(BF16)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(BF16)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(BF16)
    bias = torch.randn(batch, kv_heads, slots, generator=gen)
    for b, budgets in enumerate([(70, 5, 33), (1, 16, 47), (64, 70, 2)]):
        for g, t in enumerate(budgets):
            bias[b, g, t:segment] = float("-inf")
    lengths = [90, 75, 71]
    with torch.inference_mode():
        fast, ref = both(lambda: kernels.decode_attention(q, keys, values, lengths, 0.125, bias))
        # What the padding holds never matters: it is not read.
        keys[bias.isneginf()] = float("nan")
        values[bias.isneginf()] = float("nan")
        again = kernels.decode_attention(q, keys, values, lengths, 0.125, bias)
    assert fast.shape == (batch, heads * dim) and _rel(fast, ref) <= 2e-2
    assert torch.equal(again, fast)


@pytest.mark.parametrize("kind", ["rows", "packed", "int8"])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(kind, amx):
    """Every row count from 1 to 11 (one pass, several passes, chunks within tiles, a ragged
    last chunk) gives each row the bits it gets alone: the sums run in one order per row,
    whatever the batch (a greedy answer must not change with its neighbours). AMX tiles are
    left out: a tile's bf16 dot products sum in their own order."""
    if amx:
        pytest.skip("AMX tiles sum in their own order")
    gen = torch.Generator().manual_seed(11)
    # Wide enough that another summation order (fp32 sums ~1e-4 apart) flips some outputs'
    # bf16 rounding: ~10 of the 22K outputs, where one order flips none.
    n, k = 128 * 16 + 5, 2048
    x = torch.randn(11, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16)
    ext = kernels._kernel
    if kind == "rows":
        product = lambda rows: ext.linear_bf16(rows, w, b)  # noqa: E731
    elif kind == "packed":
        packed = ext.pack_bf16(w)
        product = lambda rows: ext.linear_packed_bf16(rows, packed, n, b)  # noqa: E731
    else:
        codes, scales = ext.pack_q8(*quantize_q8_0(w.float()))
        product = lambda rows: ext.linear_q8(rows, codes, scales, n, b)  # noqa: E731
    alone = torch.cat([product(x[i : i + 1].contiguous()) for i in range(11)])
    for m in range(2, 12):
        assert torch.equal(product(x[:m].contiguous()), alone[:m]), m


def test_a_build_killed_while_it_held_torchs_lock_does_not_stop_the_next_start(isa):
    """torch's build lock is a file only its builder removes: a server SIGKILLed while it
    compiled the kernels left it, and every later start waited on it forever."""
    import subprocess
    import sys

    files, _ = kernels.BUILDS[isa]
    source = str(kernels._HERE / files[0])
    root = Path(get_default_build_root())
    built = [f for f in root.glob(f"*/cdlm_cpu_{isa}_*") if (f / "build.ninja").exists()]
    folders = [f for f in built if source in (f / "build.ninja").read_text()]
    assert folders, f"no build of this checkout's {isa} kernels under {root}"
    for folder in folders:
        (folder / "lock").touch()  # what a builder killed mid-build leaves
    build = (
        "from cdlm_serve.models import kernels; "
        f"kernels.build_extension('cdlm_cpu_{isa}', isa='{isa}')"
    )
    done = subprocess.run([sys.executable, "-c", build], timeout=240, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
