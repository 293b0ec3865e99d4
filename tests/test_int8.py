"""int8 weights (Q8_0, models/quantize.py) and their kernels (kernels/cpu_int8.cpp: VNNI, and
AMX-INT8 tiles from 3 rows where the CPU has them; kernels/avx2_int8.cpp: AVX2), each build
this CPU runs: the format's round trip, the kernel against its PyTorch reference, and a
quantized model's fused decode step against the PyTorch path on the same (dequantized)
weights."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.model_runner import ModelRunner
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.quantize import (
    dequantize_q8_0,
    q8_linear_reference,
    quantize_model,
    quantize_q8_0,
)
from cpu_features import ISAS, kernel_build, skip_unless

BF16 = torch.bfloat16


def test_q8_0_round_trip_is_within_half_a_step_per_weight():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) * torch.logspace(-3, 1, 40)[:, None]
    w[3, 32:64] = 0  # an all-zero block: scale 0, codes 0
    codes, scales = quantize_q8_0(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert scales.shape == (40, 3) and torch.equal(scales, scales.half().float())
    assert scales[3, 1] == 0 and not codes[3, 32:64].any()
    back = dequantize_q8_0(codes, scales, torch.float32)
    step = scales.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-12).all()
    # The block's largest weight is one of its codes' extremes.
    assert (codes.view(40, 3, 32).abs().amax(-1)[scales > 0] >= 126).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 40))


def test_the_reference_is_the_dequantized_matmul_on_any_cpu():
    """`q8_linear_reference`, what the int8 kernel is checked against, checked itself on every
    machine (the kernel's tests skip without AVX512): it is the product of the dequantized
    activations and weights (each 32-block's codes times that block's own scales) up to fp32
    rounding, and within int8's error of the float product. The blocks' scales span 10^4:
    a block scaled by its neighbour's is off 10x."""
    gen = torch.Generator().manual_seed(0)
    n, k = 24, 160  # 5 blocks a row
    spread = torch.logspace(-2, 2, k // 32).repeat_interleave(32)  # per block, in both factors
    x = torch.randn(6, k, generator=gen) * spread.flip(0)
    w = torch.randn(n, k, generator=gen) * spread
    bias = torch.randn(n, generator=gen)
    codes, scales = quantize_q8_0(w)
    got = q8_linear_reference(x, codes, scales, bias)
    w_deq = dequantize_q8_0(codes, scales, torch.float64)
    # The activations as the kernel quantizes them, one 32-block at a time: codes
    # round(x * 127 / max|x|), scale max|x| / 127 in fp32 (not rounded to fp16 as weights are).
    x_deq = torch.empty(x.shape, dtype=torch.float64)
    for start in range(0, k, 32):
        block = x[:, start : start + 32]
        amax = block.abs().amax(-1, keepdim=True)
        x_codes = torch.round(block * (127.0 / amax))
        x_deq[:, start : start + 32] = x_codes.double() * (amax / 127).double()
    want = x_deq @ w_deq.T + bias.double()
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    exact = x.double() @ w.double().T + bias.double()
    assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.fixture(scope="module", params=ISAS)
def built(request):
    """Each build this CPU runs: AVX2 (VPMADDUBSW) everywhere, AVX512 (VNNI, AMX-INT8 tiles)
    where the CPU has it."""
    with kernel_build(request.param):
        yield kernels._kernel


@pytest.fixture(params=[False, True], ids=["vectors", "amx"])
def amx(request, built):
    """The product on vector registers only, or on AMX-INT8 tiles from 3 rows (the default
    where the CPU has them: the AVX512 build)."""
    if request.param and built.isa() != "avx512":
        pytest.skip("AMX tiles are the AVX512 build's")
    kernels.use_amx(request.param)
    if request.param:
        skip_unless("amx-int8", bool(built.amx_int8()), "the AMX-INT8 tile matmuls")
    assert bool(built.amx_int8()) == request.param
    yield request.param
    kernels.use_amx(True)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 16, 17, 33])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 576), (7, 32)])
def test_linear_q8_computes_its_reference(built, amx, rows, n, k):
    """Every row count (8 per VNNI pass, 4 per AVX2 pass, 16 per tile; 17 and 33 pad a last
    chunk of tiles), a ragged last tile (and half tile: n = 7, 40) and an odd one out of the
    tile pairs, a bias: the kernel's outputs are the
    reference's (the same integer dots and scales, summed in another order) to bf16 rounding;
    and both are the bf16 product up to what int8 costs."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen).to(BF16)
    codes, scales = quantize_q8_0(w)
    packed, packed_scales = built.pack_q8(codes, scales)
    calls = built.amx_int8_calls()
    got = built.linear_q8(x, packed, packed_scales, n, bias).float()
    assert built.amx_int8_calls() - calls == (amx and rows >= 3)  # the path the rows take
    want = q8_linear_reference(x, codes, scales, bias).float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2**-7 * scale  # one bf16 rounding of each
    exact = x.float() @ w.T + bias.float()
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()  # int8 weights and inputs


@pytest.fixture(scope="module")
def quantized(built, tmp_path_factory):
    """A tiny bf16 Llama (head_dim 64, every fused op applies), its weights made Q8_0."""
    folder = tmp_path_factory.mktemp("int8-llama")
    tiny_models.kernel_llama(folder)
    model = load_model(folder, dtype=BF16)[0]
    before = model.layers[0].mlp.down_proj.weight.clone()
    assert quantize_model(model) == 4 * model.config.num_layers + 1
    after = model.layers[0].mlp.down_proj.weight
    codes, scales = quantize_q8_0(before)
    assert torch.equal(after, dequantize_q8_0(codes, scales, BF16))  # torch sees Q8_0 values
    assert not torch.equal(after, before)
    packed, packed_scales = model.layers[0].mlp.down_proj.q8  # kept once, in kernel layout
    want = built.pack_q8(codes, scales)
    assert torch.equal(packed, want[0]) and torch.equal(packed_scales, want[1])
    return model


def test_a_quantized_models_fused_step_runs_int8_and_matches_pytorch(built, amx, quantized):
    """The fused step of a quantized model runs on int8 weights (the 8-token prompt on the
    tiles where AMX is on), and its logits over a prompt and two decode steps are the PyTorch
    path's on the dequantized weights, up to the activations' int8 rounding."""
    model = quantized
    model._decode_stack = None
    runner = ModelRunner(model)
    with torch.inference_mode():
        stack = runner.stack()
        assert stack is not None and stack.int8()
        ids = torch.randint(0, tiny_models.VOCAB, (10,), generator=torch.Generator().manual_seed(2))
        chunks = [[(0, ids[:8].tolist())], [(0, [int(ids[8])])], [(0, [int(ids[9])])]]
        cache = model.new_cache(1, 32)
        calls = built.amx_int8_calls()
        fused = [model.logits(runner.fused_step(stack, c, cache)).float() for c in chunks]
        assert (built.amx_int8_calls() > calls) == amx
        cache = model.new_cache(1, 32)
        with kernels.cpu_kernels(False):
            ref = [model.logits(runner.extend(c, cache)).float() for c in chunks]
    for got, want in zip(fused, ref, strict=True):
        # (the tiny random model's logits are flat: its argmax is a near tie, not compared)
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_an_unquantized_models_stack_stays_bf16(built, tmp_path):
    tiny_models.kernel_llama(tmp_path)
    model = load_model(tmp_path, dtype=BF16)[0]
    stack = ModelRunner(model).stack()
    assert stack is not None and not stack.int8()


def test_the_server_serves_int8_weights(built, tmp_path):
    """`--quantize int8`: the server's greedy answer and logprobs are those of the same model
    quantized in process (the same kernels: the server forced to this build), not those of its
    bf16 weights."""
    import httpx

    from cdlm_serve.engine.decoding.ar_engine import AREngine
    from cdlm_serve.engine.decoding.sampling import SamplingParams
    from conftest import running_server

    tiny_models.kernel_llama(tmp_path)
    prompt = [72, 101, 108, 108, 111]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    def in_process(quantize: bool) -> tuple[list[int], list[float]]:
        model = load_model(tmp_path, dtype=BF16)[0]
        if quantize:
            quantize_model(model)
        engine = AREngine(model, tiny_models.byte_tokenizer(), 512)
        outs = list(engine.generate(prompt, params))
        return [t for o in outs for t in o.token_ids], [
            lp.logprob for o in outs for lp in o.logprobs
        ]

    args = ("--device", "cpu", "--dtype", "bfloat16", "--quantize", "int8")
    args += ("--cpu-isa", built.isa())
    with running_server("--model", f"tiny={tmp_path}", *args) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}  # fmt: skip
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    tokens, logprobs = in_process(quantize=True)
    assert choice["text"] == tiny_models.byte_tokenizer().decode(tokens)
    assert max(abs(a - b) for a, b in zip(served, logprobs, strict=True)) <= 1e-4
    _, plain = in_process(quantize=False)
    assert max(abs(a - b) for a, b in zip(served, plain, strict=True)) > 1e-3
