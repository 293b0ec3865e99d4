"""One short check of the CUDA path (at most ~8 minutes on one GPU), a table and a JSON file:

1. the CUDA test subset (`pytest -m cuda`: every model family in bf16 against an fp32
   reference, the engines and the reference decoders' golden outputs on the device);
2. AR decode tokens/s at batch 1 and 16, on a randomly initialised model with Qwen2-7B's shapes
   (Dream-7B's backbone), bf16;
3. the diffusion step at block 32 on a random model with Dream-7B's shapes, bf16: a full
   recompute (prompt + whole answer, bidirectional) vs a cached block step, and (float32, tiny
   shapes) how far the cached block's logits are from a whole block-causal pass's;
4. compaction of an 8K-token context (am-highest-fast, 10x) on the Qwen2-7B-shaped model;
5. the shipped teacher and student: latency, steps and tokens/s of vanilla / fast_dllm / cdlm on
   held-out prose prompts, batch 1.

    python -m cdlm_serve.bench.gpu_check [--json gpu_check.json]
    python -m cdlm_serve.bench.gpu_check --device cpu --tiny   # the dry run the test suite runs

Nothing is downloaded: random weights, and the shipped models that come with the package.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cdlm_serve.bench import cdlm_suites
from cdlm_serve.engine.compaction import CompactionRuntime, CompactionSpec, compact_row
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.dlm_engine import DLMEngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.engine.served_model import load_tokenizer
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import resolve
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.train.data import held_out_prose
from cdlm_serve.train.tokenizer import byte_tokenizer

# Qwen2-7B's (and so Dream-7B's) shapes; --tiny shrinks them for the CPU dry run.
QWEN2_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}


def random_model(kind: str, shapes: dict, device: str, dtype: torch.dtype) -> Transformer:
    """A randomly initialised qwen2-layout model (kind "qwen2") or Dream (kind "Dream"),
    built directly on the device."""
    raw = {
        "model_type": kind,
        **shapes,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": shapes["vocab_size"] - 2,
    }
    if kind == "Dream":
        raw["mask_token_id"] = shapes["vocab_size"] - 1
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf_dict(raw), dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm gains
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cuda_tests(timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    cmd.append(str(Path(__file__).resolve().parents[2] / "tests" / "test_cuda.py"))
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return {"summary": tail, "seconds": round(time.perf_counter() - t, 1), **counts}


@torch.inference_mode()
def decode_speed(model: Transformer, device: str, tokens: int) -> dict:
    """Greedy decode tokens/s through the AR engine at batch 1 and 16 (prompts of 128)."""
    engine = AREngine(model, byte_tokenizer(), 4096, max_batch=16)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for batch in (1, 16):
        prompts = [[(7 * i + j) % 200 + 3 for j in range(128)] for i in range(batch)]

        def run(prompts=prompts) -> int:
            for i, ids in enumerate(prompts):
                engine.add(engine.new_sequence(f"r{i}", ids, params))
            n = 0
            while engine.has_work():
                n += sum(len(o.token_ids) for o in engine.step())
            return n

        run()  # warm-up
        sync(device)
        t = time.perf_counter()
        n = run()
        sync(device)
        out[f"batch_{batch}_tok_s"] = round(n / (time.perf_counter() - t), 1)
    return out


@torch.inference_mode()
def dlm_step(model: Transformer, device: str, prompt: int, answer: int, repeats: int) -> dict:
    """One step at block 32: full recompute vs the cached block (the answer's last block)."""
    block = 32
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (1, prompt + answer), generator=gen).to(device)
    full = median_seconds(
        lambda: model(ids, pattern=AttentionPattern.bidirectional()), device, repeats
    )
    pattern = AttentionPattern.block_causal(block, prompt)
    cache = model.new_cache(1, prompt + answer + block)
    model(ids[:, : prompt + answer - block], cache=cache, pattern=pattern)
    last = ids[:, prompt + answer - block :]
    cached = median_seconds(
        lambda: model(last, cache=cache, pattern=pattern, commit=False), device, repeats
    )
    return {
        "prompt": prompt,
        "answer": answer,
        "full_ms": round(full * 1e3, 2),
        "cached_block_ms": round(cached * 1e3, 2),
        "ratio": round(full / cached, 1),
        **cached_block_error(device, prompt, answer, block),
    }


@torch.inference_mode()
def cached_block_error(device: str, prompt: int, answer: int, block: int) -> dict:
    """The timing above is only worth printing if the cached block computes what a whole
    block-causal pass computes at those positions (the exact-reuse claim). Checked in float32
    on the tiny Dream shapes, where kernel reorderings stay near 1e-6 of the logits' scale and a
    real fault (a RoPE offset, a wrong mask) is thousands of times that; bf16 would hide it."""
    model = random_model("Dream", TINY, device, torch.float32)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"] - 2, (1, prompt + answer), generator=gen).to(device)
    pattern = AttentionPattern.block_causal(block, prompt)
    cache = model.new_cache(1, prompt + answer)
    model(ids[:, : prompt + answer - block], cache=cache, pattern=pattern)
    reuse = model(ids[:, prompt + answer - block :], cache=cache, pattern=pattern, commit=False)
    whole = model(ids, pattern=pattern)[:, -block:]  # [1, block, V]
    return {
        "cached_vs_whole_max_abs": float((reuse - whole).abs().max()),
        "logit_scale": float(whole.abs().max()),
    }


@torch.inference_mode()
def compaction(model: Transformer, device: str, tokens: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 250, (tokens,), generator=gen).tolist()
    cache = model.new_cache(1, tokens + 64)
    for start in range(0, tokens, 2048):  # prefill in chunks, as the engine does
        model(torch.tensor([ids[start : start + 2048]], device=device), cache=cache)
    sync(device)
    t = time.perf_counter()
    report = compact_row(
        model,
        cache,
        0,
        ids,
        CompactionSpec.exact(tokens // 10, method="am-highest-fast"),
        CompactionRuntime(tokenizer=byte_tokenizer()),
    )
    sync(device)
    return {
        "tokens": tokens,
        "seconds": round(time.perf_counter() - t, 2),
        "stages": {k: round(v, 2) for k, v in report.seconds.items()},
        "ratio": round(report.ratio, 1),
        "output_error": round(report.output_error, 4),
    }


def shipped_latency(device: str, dtype: torch.dtype, prompts: int, max_tokens: int) -> dict:
    """The shipped teacher (vanilla, fast_dllm) and student (cdlm) at batch 1."""
    engines = {}
    for name in ("cdlm-teacher", "cdlm-student"):
        folder = resolve(name)
        model, ckpt = load_model(folder, device=device, dtype=dtype)
        tok = load_tokenizer(ckpt.tokenizer_folder or folder)
        engines[name] = DLMEngine(model, tok, model.config.max_position_embeddings, max_batch=1)
    rows = [
        cdlm_suites.Row(d, engines["cdlm-student" if d == "cdlm" else "cdlm-teacher"], d)
        for d in ("vanilla", "fast_dllm", "cdlm")
    ]
    texts = [p for p, _ in held_out_prose(prompts)]
    args = argparse.Namespace(max_tokens=max_tokens, block_size=None, threshold=None)
    cdlm_suites.text_runs(rows, texts[:1], args)  # warm-up
    runs = cdlm_suites.text_runs(rows, texts, args)
    return {
        name: {
            "latency_s": round(statistics.median(r[0] for r in done), 4),
            "steps": round(statistics.mean(r[1] for r in done), 1),
            "tok_s": round(sum(r[2] for r in done) / sum(r[0] for r in done), 1),
        }
        for name, done in runs.items()
    }


def _print(result: dict) -> None:
    print(f"\ngpu_check on {result['device_name']} ({result['dtype']}, shapes {result['shapes']})")
    t = result["cuda_tests"]
    print(f"{'pytest -m cuda':<34}{t['summary']}")
    d = result["decode"]
    print(f"{'AR decode, batch 1':<34}{d['batch_1_tok_s']:>10} tok/s")
    print(f"{'AR decode, batch 16':<34}{d['batch_16_tok_s']:>10} tok/s")
    s = result["dlm_step"]
    print(
        f"{'DLM step, block 32':<34}full {s['full_ms']} ms, cached block {s['cached_block_ms']} "
        f"ms ({s['ratio']}x), prompt {s['prompt']} + answer {s['answer']}"
    )
    print(
        f"{'cached block vs whole pass (fp32)':<34}max |diff| {s['cached_vs_whole_max_abs']:.2e} "
        f"of logits up to {s['logit_scale']:.2f}"
    )
    c = result["compaction"]
    print(
        f"{'compaction am-highest-fast 10x':<34}{c['tokens']} tokens in {c['seconds']} s "
        f"{c['stages']} (error {c['output_error']})"
    )
    print(f"{'shipped models, batch 1':<34}{'latency':>10}{'steps':>8}{'tok/s':>9}")
    for name, r in result["shipped"].items():
        print(f"{'  ' + name:<34}{r['latency_s']:>9.3f}s{r['steps']:>8}{r['tok_s']:>9}")
    print(f"total {result['seconds']} s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (the CPU dry run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device, tiny = args.device, args.tiny
    dtype = torch.bfloat16
    shapes = TINY if tiny else QWEN2_7B
    result: dict = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": "bfloat16",
        "shapes": "tiny" if tiny else "Qwen2-7B / Dream-7B",
        "torch": torch.__version__,
    }
    result["cuda_tests"] = cuda_tests(timeout=240)
    model = random_model("qwen2", shapes, device, dtype)
    result["decode"] = decode_speed(model, device, tokens=16 if tiny else 128)
    result["compaction"] = compaction(model, device, tokens=512 if tiny else 8192)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    model = random_model("Dream", shapes, device, dtype)
    prompt, answer = (64, 64) if tiny else (512, 256)
    result["dlm_step"] = dlm_step(model, device, prompt, answer, repeats=3 if tiny else 10)
    del model
    result["shipped"] = shipped_latency(
        device, dtype, prompts=2 if tiny else 20, max_tokens=32 if tiny else 256
    )
    result["seconds"] = round(time.perf_counter() - started, 1)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
