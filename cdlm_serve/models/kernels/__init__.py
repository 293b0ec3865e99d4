"""The model's elementwise and matrix ops, with optional fused CPU kernels for decoding.

Every op here has a PyTorch implementation (the reference, used on GPUs, in fp32, for long
inputs, and whenever autograd records). For a few rows of bf16 activations on an x86 CPU, the
fused kernels (compiled on first use by torch's extension loader, cached) do the same work
without PyTorch's per-op dispatch cost, which at decode sizes exceeds the arithmetic: a
576-wide RMSNorm is ~30 us as 7 eager ops, ~1 us fused. There are two builds of the same ops
and the same fused decode step (`DecodeStack`): AVX512 (`cpu_decode.cpp`, `cpu_int8.cpp`:
AVX512-BF16 dot products, VNNI, AMX) and AVX2 (`avx2_decode.cpp`, `avx2_int8.cpp`: x86-64-v3,
bf16 widened to fp32 in registers), one picked at run time from the CPU's features
(`cpu_isa`, or CDLM_SERVE_CPU_ISA). `enable_cpu_kernels()` turns them on; tests compare every
kernel of both builds with its reference.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from cdlm_serve.models.rope import apply_rotary

log = logging.getLogger(__name__)

MAX_KERNEL_ROWS = 8
_HERE = Path(__file__).parent
# Each instruction set's build: its sources (they share common.h, decode_stack.h, bindings.h)
# and compiler flags. AVX512: AVX512-BF16 dot products and VNNI int8 (AMX where the compiler
# has it); AVX2: x86-64-v3 (AVX2, FMA, F16C), bf16 widened to fp32 in registers.
BUILDS = {
    "avx512": (
        ("cpu_decode.cpp", "cpu_int8.cpp"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c"),
    ),
    "avx2": (("avx2_decode.cpp", "avx2_int8.cpp"), ("-mavx2", "-mfma", "-mf16c")),
}
# The CPU features each build needs (/proc/cpuinfo's names). Every CPU with AVX512-BF16 has
# AVX512-VNNI too (the int8 kernels); checked all the same.
_FEATURES = {
    "avx512": ("avx512_bf16", "avx512bw", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
}
ISA_ENV = "CDLM_SERVE_CPU_ISA"  # avx512 | avx2 | native (the default: the best this CPU has)
_lock = threading.Lock()
_kernel: Any = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has(isa: str) -> bool:
    """Whether this CPU can run the kernels built for `isa` ("avx512" or "avx2")."""
    return set(_FEATURES[isa]) <= _cpu_flags()


def cpu_has_bf16_dot() -> bool:
    return cpu_has("avx512")


def cpu_isa() -> str | None:
    """The instruction set the fused CPU kernels use here: the best the CPU has (AVX512-BF16,
    else AVX2), or the one CDLM_SERVE_CPU_ISA names (forcing avx2 on an AVX512 machine tests or
    measures that path); None where neither runs (no AVX2, or kernels turned off)."""
    if os.environ.get("CDLM_SERVE_CPU_KERNELS", "1") == "0":
        return None
    asked = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if asked not in ("native", *BUILDS):
        raise ValueError(f"{ISA_ENV}={asked!r}: expected native, avx512 or avx2")
    for isa in BUILDS if asked == "native" else (asked,):
        if cpu_has(isa):
            return isa
    return None


def isa_choice() -> str:
    """A line for the start-up log: which kernels run here, and why."""
    asked = os.environ.get(ISA_ENV, "native")
    isa = cpu_isa()
    if isa is None:
        if os.environ.get("CDLM_SERVE_CPU_KERNELS", "1") == "0":
            return "no fused CPU kernels (CDLM_SERVE_CPU_KERNELS=0)"
        return f"no fused CPU kernels: this CPU lacks {'/'.join(_FEATURES['avx2'])}"
    why = f"{ISA_ENV}={asked}" if asked != "native" else "the best this CPU has"
    return f"fused CPU kernels: {isa} ({why})"


@cache
def _build(isa: str) -> Any:
    return build_extension(f"cdlm_cpu_{isa}", isa=isa)


def build_extension(
    name: str,
    sources: list[str] | None = None,
    defines: tuple[str, ...] = (),
    isa: str = "avx512",
) -> Any:
    """Compile (or load from torch's extension cache) the CPU kernels for `isa` as module
    `name` (from `sources`, by default that build's own), with AMX where the build and the
    compiler have it. bench.kernel_ab builds another checkout's kernels through it, under
    another name and with `DecodeStack` renamed (`defines`), so that both load in one
    process."""
    files, isa_flags = BUILDS[isa]
    sources = sources or [str(_HERE / f) for f in files]
    flags = ["-O3", *isa_flags, "-fopenmp", *(f"-D{d}" for d in defines)]
    amx = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"] if isa == "avx512" else []
    try:
        return _load(name, sources, flags + amx)
    except Exception as e:
        if not amx:
            raise
        log.warning("building the CPU kernels without AMX: %s", e)  # a compiler without it
        return _load(name + "_noamx", sources, flags)


def build_folder(name: str, sources: list[str], cflags: list[str]) -> Path:
    """Where `_load` builds `name` from `sources` (per Python, torch and checkout)."""
    import hashlib

    from torch.utils.cpp_extension import get_default_build_root

    where = hashlib.sha256("\0".join([*sources, *cflags]).encode()).hexdigest()[:12]
    abi = f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch.__version__}"
    return Path(get_default_build_root()) / abi / f"{name}_{where}"


def _load(name: str, sources: list[str], cflags: list[str]) -> Any:
    """torch's `load`, in a build folder of this checkout's own, under a lock the system drops
    when its holder dies. torch's own lock is a file that only its builder removes: a server
    killed while it compiled (a SIGKILL, an OOM) left every later start waiting on it forever.
    Holding ours, any lock file of torch's there is such a leftover, and goes. The folder is
    per checkout (its sources' paths): two checkouts sharing one rebuilt it for each other."""
    import fcntl

    from torch.utils.cpp_extension import load

    folder = build_folder(name, sources, cflags)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (folder / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            sources=sources,
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


def enable_cpu_kernels() -> bool:
    """Build (or load from cache) the CPU kernels for this machine's instruction set
    (`cpu_isa`) if it has one. Safe to call repeatedly and from several threads; returns
    whether the kernels are active."""
    global _kernel
    isa = cpu_isa()
    if isa is None:
        return False
    with _lock:
        if _kernel is None or (_kernel and _kernel.isa() != isa):
            try:
                _kernel = _build(isa)
            except Exception as e:  # no compiler, no ninja, ...: fall back to PyTorch's ops
                log.warning("CPU %s kernels unavailable, using PyTorch's ops: %s", isa, e)
                _kernel = False
            else:
                use_amx(os.environ.get("CDLM_SERVE_AMX", "1") != "0")
    return bool(_kernel)


def active_isa() -> str | None:
    """The instruction set of the kernels in use (None: PyTorch's ops)."""
    return _kernel.isa() if _kernel else None


def use_amx(enabled: bool) -> bool:
    """Let the packed decode matmuls run on AMX tiles (where the CPU, the OS and the compiler
    allow it) or keep them on AVX512; returns whether AMX is now in use."""
    return bool(_kernel) and bool(_kernel.set_amx(enabled))


@contextmanager
def cpu_kernels(enabled: bool) -> Iterator[None]:
    """Temporarily turn the fused kernels on (if buildable here) or off; for tests and
    benchmarks that compare the two paths."""
    global _kernel
    saved = _kernel
    if enabled:
        enable_cpu_kernels()
    else:
        _kernel = None
    try:
        yield
    finally:
        _kernel = saved


@contextmanager
def extension(ext: Any) -> Iterator[None]:
    """Temporarily route the kernels through another build of them (`build_extension`): a
    decode stack built inside keeps that build's kernels for its model."""
    global _kernel
    saved = _kernel
    _kernel = ext
    try:
        yield
    finally:
        _kernel = saved


def _fast(x: Tensor, rows: int | None = None, *params: Tensor | None) -> bool:
    """Whether the fused CPU kernels apply: bf16 on CPU, few rows, nothing for autograd to
    record (the kernels have no backward)."""
    if not _kernel or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    if rows is not None and rows > MAX_KERNEL_ROWS:
        return False
    tensors = [x, *(p for p in params if p is not None)]
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K]^T + bias -> [..., N]."""
    k = weight.shape[1]
    rows = x.numel() // k
    if _fast(x, rows, weight, bias) and weight.dtype == torch.bfloat16:
        y: Tensor = _kernel.linear_bf16(x.reshape(rows, k).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if (
        _kernel
        and rows > 1
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        y = _kernel.linear_split(x.reshape(rows, k).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    if rows == 1:
        # One row is a matrix-vector product; torch.mv streams weights faster than F.linear's
        # GEMM path on CPU and is the same cuBLAS GEMV on CUDA.
        y = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in HF's rounding order: normalize in fp32, cast back, scale.
    The kernel takes any row count (a prefill's rows in parallel): torch's version makes three
    fp32 temporaries the size of x, ~15 ms for 8K rows of 576 against ~1 ms."""
    k = x.shape[-1]
    if _fast(x, None, weight) and weight.dtype == torch.bfloat16:
        normed: Tensor = _kernel.rms_norm_bf16(x.reshape(-1, k).contiguous(), weight, eps)
        return normed.view(x.shape)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual): the residual add fused with the next norm."""
    k = x.shape[-1]
    bf16 = residual.dtype == weight.dtype == torch.bfloat16
    if _fast(x, None, residual, weight) and bf16 and residual.shape == x.shape:
        normed, summed = _kernel.add_rms_norm_bf16(
            x.reshape(-1, k).contiguous(), residual.reshape(-1, k).contiguous(), weight, eps
        )
        return normed.view(x.shape), summed.view(x.shape)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_mul(gate_up: Tensor) -> Tensor:
    """[..., 2I] (gate, up) -> silu(gate) * up [..., I]."""
    two_i = gate_up.shape[-1]
    if _fast(gate_up, gate_up.numel() // two_i):
        out: Tensor = _kernel.silu_mul_bf16(gate_up.reshape(-1, two_i).contiguous())
        return out.view(*gate_up.shape[:-1], two_i // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_mul(gate_up: Tensor) -> Tensor:
    """[..., 2I] (gate, up) -> gelu_tanh(gate) * up [..., I] (Gemma's GeGLU)."""
    two_i = gate_up.shape[-1]
    if _fast(gate_up, gate_up.numel() // two_i):
        out: Tensor = _kernel.gelu_mul_bf16(gate_up.reshape(-1, two_i).contiguous())
        return out.view(*gate_up.shape[:-1], two_i // 2)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotate_qk(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Apply rotate-half RoPE to the first `n_heads` heads of qkv [B, Q, W] (q heads, then k
    heads); cos/sin broadcast to [B, Q, 1, D]. May rotate in place; returns the result."""
    batch, q_len, width = qkv.shape
    if _fast(qkv, batch * q_len) and qkv.is_contiguous() and head_dim % 32 == 0:
        cos2 = cos.expand(batch, q_len, 1, head_dim).reshape(batch * q_len, head_dim)
        sin2 = sin.expand(batch, q_len, 1, head_dim).reshape(batch * q_len, head_dim)
        _kernel.rope_inplace_bf16(
            qkv.view(batch * q_len, width), cos2.contiguous(), sin2.contiguous(), n_heads, head_dim
        )
        return qkv
    rot = n_heads * head_dim
    rotated = apply_rotary(qkv[..., :rot].view(batch, q_len, n_heads, head_dim), cos, sin)
    return torch.cat([rotated.reshape(batch, q_len, rot), qkv[..., rot:]], dim=-1)


@dataclass(frozen=True, slots=True)
class PackedKV:
    """One layer's keys and values [Hkv, K, D] packed for `attend_packed` (and their bias
    [Hkv, K] fp32 or None): packed once, read by every query chunk of a long forward."""

    keys: Tensor
    values: Tensor
    length: int
    bias: Tensor | None


def packs_attention(q: Tensor, k: Tensor) -> bool:
    """Whether `pack_attention` / `attend_packed` apply to q [B, H, Q, D] over k [B, Hkv, K,
    D]: the fused kernels on (bf16 on a CPU they run on), one row, head_dim 32, 64 or 128."""
    return (
        _fast(q, None, k)
        and k.dtype == torch.bfloat16
        and q.shape[0] == k.shape[0] == 1
        and q.shape[-1] in (32, 64, 128)
    )


def pack_attention(k: Tensor, v: Tensor, bias: Tensor | None) -> PackedKV:
    """k, v [1, Hkv, K, D] bf16 (rows contiguous) and bias [1, Hkv, K] or None, packed."""
    keys, values = _kernel.pack_attention_kv(k[0], v[0])
    flat = None if bias is None else bias[0].float().contiguous()
    return PackedKV(keys, values, k.shape[2], flat)


def attend_packed(
    q: Tensor,
    packed: PackedKV,
    ranges: list[tuple[int, int]],
    scale: float,
    limits: Tensor | None = None,
) -> Tensor:
    """Query rows q [H, R, D] bf16 over `packed`'s keys in `ranges` ([a, b), disjoint, in
    order), row i also only below limits[i] (int64 [R]) where given -> [H, R, D] bf16. The
    fused kernel: scores, an online softmax in fp32 and the weighted values in one pass
    over the keys, no [R, K] scores in memory (`cpu_decode.cpp` attend_packed_bf16)."""
    flat = [x for pair in ranges for x in pair]
    return cast(
        Tensor,
        _kernel.attend_packed_bf16(
            q, packed.keys, packed.values, packed.length, flat, limits, scale, packed.bias
        ),
    )


def fuses_decode_attention(q: Tensor, k: Tensor) -> bool:
    """Whether `decode_attention` runs the fused kernel for q [B, H, D] over k [B, Hkv, S, D]
    (bf16 on a CPU the kernels run on, nothing for autograd, head_dim a multiple of 32 up to
    256)."""
    d = q.shape[-1]
    return _fast(q, None, k) and k.dtype == torch.bfloat16 and d % 32 == 0 and d <= 256


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    lengths: list[int],
    scale: float,
    bias: Tensor | None,
) -> Tensor:
    """One query per row against its cache: q [B, H, D] (heads contiguous); keys/values
    [B, Hkv, S, D] whole buffers; row b attends to slots [0, lengths[b]); bias [B, Hkv, S] fp32
    or None. Returns [B, H * D]. The fused decode step calls the kernel from C++; this
    function is its reference and its test entry point."""
    if _fast(q) and q.shape[-1] % 32 == 0:
        return cast(Tensor, _kernel.decode_attention_bf16(q, keys, values, lengths, scale, bias))
    heads, dim = q.shape[1:]
    group = heads // keys.shape[1]
    rows = []
    for b, n in enumerate(lengths):
        k = keys[b, :, :n].repeat_interleave(group, dim=0).float()  # [H, n, D]
        v = values[b, :, :n].repeat_interleave(group, dim=0).float()
        scores = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale
        if bias is not None:
            scores = scores + bias[b, :, :n].repeat_interleave(group, dim=0)
        rows.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), v).reshape(heads * dim))
    return torch.stack(rows).to(q.dtype)


def _bf16_exact(x: Tensor) -> bool:
    return x.dtype == torch.bfloat16 or torch.equal(x.bfloat16().float(), x)


def repeat_max(
    queries: Tensor, keys: Tensor, bias: Tensor, scale: float, region: int, best: Tensor
) -> bool:
    """KVzip's running log maxima, in place: best [region] = max(best, max_r log softmax(s_r)
    [:region]) for the scores s = queries [N, D] @ keys [C, D]^T * scale + bias [C] (fp32
    best; `engine.compaction.attention_matching.repeat_max_scores`). On the CPU kernels: where
    both hold bf16 values (a bf16 model's) and the CPU has AVX512-BF16, the scores are bf16
    dot products (exact products, fp32 sums: the fp32 GEMM's up to the order of the sums, in
    half its time), else fp32 GEMMs. Returns False (nothing done) where the kernels are off or
    the tensors are not on the CPU; the caller then scores with torch."""
    if not (_kernel and keys.device.type == "cpu"):
        return False
    if _kernel.isa() == "avx512" and _bf16_exact(queries) and _bf16_exact(keys):
        q, k = queries.bfloat16().contiguous(), keys.bfloat16().contiguous()
    else:
        q, k = queries.float().contiguous(), keys.float().contiguous()
    _kernel.repeat_max(q, k, bias.float().contiguous(), scale, region, best)
    return True


def pack_q8(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor] | None:
    """Q8_0 codes [N, K] and scales [N, K/32] in the int8 kernel's layout (what the fused
    step reads), or None where the kernels are off."""
    if not _kernel:
        return None
    packed, packed_scales = _kernel.pack_q8(codes, scales)
    return packed, packed_scales


def fused_step_takes(cfg: Any) -> bool:
    """Whether the fused decode step implements this config's model (where the kernels run):
    pre-norm blocks (Gemma's sandwich norms too), a SiLU or GELU-tanh gate, global or
    sliding-window layers, head_dim a multiple of 32 up to 256."""
    return (
        cfg.hidden_act in ("silu", "gelu_tanh") and cfg.head_dim % 32 == 0 and cfg.head_dim <= 256
    )


def decode_stack(model: Any) -> Any | None:
    """The model's layers as one fused C++ decode step (`DecodeStack`), or None where the
    kernels do not apply (GPU, fp32, head_dim not a multiple of 32, training). Built once per
    model and kept on it; rebuilt if its weights are replaced."""
    cfg = model.config
    weight = model.embed_tokens.weight
    if not _fast(weight) or weight.requires_grad or not fused_step_takes(cfg):
        return None
    cached = _built_stack(model)
    if cached is not None:
        return cached
    layers = []
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        q_norm = attn.q_norm.weight if attn.q_norm is not None else None
        k_norm = attn.k_norm.weight if attn.k_norm is not None else None
        matrices = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # int8 (Q8_0) codes and scales of the four matrices, where quantize_model gave them.
        int8 = [t for m in matrices for t in (_q8_of(m) or (None, None))]
        layers.append(
            [
                block.attn_norm.weight,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
                q_norm,
                k_norm,
                attn.o_proj.weight,
                attn.o_proj.bias,
                block.mlp_norm.weight,
                mlp.gate_up_proj.weight,
                mlp.gate_up_proj.bias,
                mlp.down_proj.weight,
                mlp.down_proj.bias,
                *(int8 if any(t is not None for t in int8) else []),
                *(
                    [block.attn_post_norm.weight, block.mlp_post_norm.weight]
                    if block.attn_post_norm is not None and block.mlp_post_norm is not None
                    else []
                ),
            ]
        )
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    head_codes, head_scales = _q8_of(head) or (None, None)
    args = [
        layers,
        model.norm.weight,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        cfg.scale,
        os.environ.get("CDLM_SERVE_PACKED", "1") != "0",
        head.weight,
        head_codes,
        head_scales,
    ]
    if cfg.local_layers or cfg.hidden_act != "silu":  # (a build before them takes the 11)
        args += [[cfg.is_local(i) for i in range(cfg.num_layers)], cfg.hidden_act == "gelu_tanh"]
    stack = _kernel.DecodeStack(*args)
    params = list(model.parameters())
    model._decode_stack = (params, [p.data_ptr() for p in params], stack, _kernel)
    return stack


def _q8_of(module: Any) -> tuple[Tensor, Tensor] | None:
    """A module's int8 weights, as models.quantize.quantize_model keeps them (`module.q8`)."""
    q8: tuple[Tensor, Tensor] | None = getattr(module, "q8", None)
    return q8


def _built_stack(model: Any) -> Any | None:
    """The model's decode stack if one was built for its current weights by the kernels in use
    (None if never built, if the weights moved since: `.to()`, `param.data = ...`, or if
    another instruction set's build is in use now). Checked on every decode step, so against
    the parameter objects listed at build time (~15 us), not a walk of the module tree (~1 ms
    for SmolLM2)."""
    cached = getattr(model, "_decode_stack", None)
    if cached is None:
        return None
    params, ptrs, stack, built_by = cached
    if built_by is not _kernel:
        return None
    return stack if all(p.data_ptr() == q for p, q in zip(params, ptrs, strict=True)) else None


def head_logits(model: Any, hidden: Tensor) -> Tensor | None:
    """hidden [B, hidden] -> logits [B, vocab] through the decode stack's packed output head,
    or None where it does not apply (no stack built for this model, GPU, fp32)."""
    if hidden.dim() != 2 or not _fast(hidden):
        return None
    stack = _built_stack(model)
    return stack.logits(hidden) if stack is not None else None


def argmax(logits: Tensor) -> Tensor:
    """[B, V] -> [B] int64, first index on ties. torch.argmax on CPU takes ~100-250 us for a
    49k vocabulary; the kernel's vector loop (bf16 read as is) a few us."""
    if _kernel and logits.device.type == "cpu" and logits.dim() == 2:
        return cast(Tensor, _kernel.argmax_rows(logits))
    return logits.argmax(dim=-1)
