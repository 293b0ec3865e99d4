"""What batch-invariant mode (`--batch-invariant`) costs: AR throughput with the mode off and on,
side by side, at 1 and 8 clients and at two prefill chunk sizes (with `--dlm`, the diffusion
engine's three decoders too, on the shipped models: held-out trace problems, blocks of 8).

The engine runs in this process (no HTTP: the mode changes nothing outside the engine's steps).
Each client is a closed loop of greedy requests (a prompt of `--prompt-tokens`, `--new-tokens`
answer tokens, ignore_eos): its next request joins as soon as its last one finishes, so prompts
are prefilled while the others decode, as on a busy server. Reported: generated tokens/s over
the run's wall time (prefills included), the median of `--runs` interleaved runs (off, on, off,
on, ...) so that machine noise hits both, and on/off.

At 128 prompt tokens a step (the server's CPU default) both modes take the same path: every
step already fits the fused step. Past it (`--prefill-tokens-per-step`, the GPU default 512)
the mode keeps prompts on the fused step, where the PyTorch path would have taken them.

    python -m cdlm_serve.bench.batch_invariant [--clients 1 8] [--prefill 128 512] [--runs 3]
                                               [--dlm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cdlm_serve.bench.decode import prompt_ids
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.models import kernels
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.sources import DEFAULT_AR_MODEL, resolve
from cdlm_serve.models.transformer import Transformer

MODES = {"off": False, "on": True}


def tok_s(
    model: Transformer,
    tokenizer: object,
    invariant: bool,
    clients: int,
    prefill: int,
    prompts: list[list[int]],
    new_tokens: int,
) -> float:
    """Generated tokens/s of `clients` closed loops over `prompts` (each client takes every
    `clients`-th prompt in turn) on a fresh engine."""
    limit = model.config.max_position_embeddings
    engine = AREngine(model, tokenizer, limit, clients, prefill, batch_invariant=invariant)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    queues = [prompts[c::clients] for c in range(clients)]
    owner: dict[str, int] = {}

    def submit(client: int) -> None:
        if queues[client]:
            rid = f"{client}-{len(queues[client])}"
            owner[rid] = client
            engine.add(engine.new_sequence(rid, queues[client].pop(0), params))

    generated = 0
    started = time.perf_counter()
    for c in range(clients):
        submit(c)
    while engine.has_work():
        for out in engine.step():
            generated += len(out.token_ids)
            if out.finish_reason is not None:
                submit(owner[out.request_id])
    return generated / (time.perf_counter() - started)


DLM_MODELS = {"cdlm": "cdlm-student", "fast_dllm": "cdlm-teacher", "vanilla": "cdlm-teacher"}


def dlm_tok_s(
    model: Transformer, decoding: str, invariant: bool, clients: int, prompts: list[str]
) -> float:
    """Generated tokens/s of the diffusion engine decoding `prompts`, `clients` at a time in
    closed loops (a finished answer's client sends its next prompt), greedy, blocks of 8."""
    from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
    from cdlm_serve.train.data import KINDS
    from cdlm_serve.train.tokenizer import byte_tokenizer

    engine = DLMEngine(model, byte_tokenizer(), 512, clients, batch_invariant=invariant)
    params = DLMParams(max_tokens=KINDS["trace4"].answer_len, decoding=decoding, block_size=8)
    waiting = list(prompts)

    def submit() -> None:
        if waiting:
            prompt = waiting.pop(0)
            engine.add(engine.new_sequence(str(len(waiting)), list(prompt.encode()), params))

    generated = 0
    started = time.perf_counter()
    for _ in range(clients):
        submit()
    while engine.has_work():
        for out in engine.step():
            generated += len(out.token_ids)
            if out.finish_reason is not None:
                submit()
    return generated / (time.perf_counter() - started)


def dlm_rows(clients: list[int], requests_per_client: int, runs: int) -> list[dict]:
    """The diffusion engine's decoders on the shipped models (bf16), held-out trace problems."""
    from cdlm_serve.train.tasks import TASKS

    models = {n: load_model(resolve(n), dtype=torch.bfloat16)[0] for n in set(DLM_MODELS.values())}
    problems = [ex.prompt for ex in TASKS["trace4"].held_out()]
    rows = []
    for decoding, name in DLM_MODELS.items():
        for n in clients:
            use = problems[: n * requests_per_client]
            speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(runs):
                for mode, invariant in MODES.items():
                    speed = dlm_tok_s(models[name], decoding, invariant, n, use)
                    speeds[mode].append(round(speed, 2))
            rows.append(_row(decoding, n, speeds))
    return rows


def _row(setting: object, clients: int, runs: dict[str, list[float]]) -> dict:
    off, on = (statistics.median(runs[name]) for name in MODES)
    return {
        "setting": setting,
        "clients": clients,
        "off": off,
        "on": on,
        "on_off": round(on / off, 3),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_AR_MODEL)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefill", type=int, nargs="*", default=[128, 512])  # none: no AR rows
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dlm", action="store_true", help="also the diffusion engine's decoders")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    kernels.enable_cpu_kernels()
    folder = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model, _ = load_model(folder, dtype=torch.bfloat16)
    base = prompt_ids(tokenizer, args.prompt_tokens + 64)
    # Distinct prompts (each starts at its own offset of the text): no two share a prefix.
    most = max(args.clients) * args.requests_per_client
    prompts = [base[i % 64 : i % 64 + args.prompt_tokens] for i in range(most)]

    tok_s(model, tokenizer, True, 1, 128, prompts[:1], 8)  # warm-up: allocator, kernel caches
    rows = []
    for prefill in args.prefill:
        for clients in args.clients:
            use = prompts[: clients * args.requests_per_client]
            runs: dict[str, list[float]] = {name: [] for name in MODES}
            for _ in range(args.runs):
                for name, invariant in MODES.items():
                    speed = tok_s(
                        model, tokenizer, invariant, clients, prefill, use, args.new_tokens
                    )
                    runs[name].append(round(speed, 2))
            rows.append(_row(f"AR, prefill {prefill}", clients, runs))
    if args.dlm:
        rows += dlm_rows(args.clients, args.requests_per_client, args.runs)
    result = {
        "model": args.model,
        "isa": kernels.active_isa(),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests_per_client": args.requests_per_client,
        "rows": rows,
    }
    _print(result, args.runs)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict, runs: int) -> None:
    print(
        f"\nbatch-invariant mode, bf16, {result['isa']} kernels, {result['threads']} threads; "
        f"each client {result['requests_per_client']} greedy requests in a loop (AR: "
        f"{result['model']}, {result['prompt_tokens']}-token prompts, {result['new_tokens']} "
        f"new tokens; diffusion: the shipped models, trace problems); generated tok/s, median "
        f"of {runs} interleaved runs"
    )
    print(f"{'':18}{'clients':>9}{'off':>9}{'on':>9}{'on/off':>8}   runs off | on")
    for r in result["rows"]:
        print(
            f"{r['setting']:18}{r['clients']:>9}{r['off']:>9.1f}{r['on']:>9.1f}"
            f"{r['on_off']:>8.3f}   {r['runs']['off']} | {r['runs']['on']}"
        )


if __name__ == "__main__":
    main()
