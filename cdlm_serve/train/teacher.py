"""Train the teacher: a small bidirectional masked-diffusion LM, from scratch, LLaDA's way.

Objective (LLaDA): per sequence a mask ratio t ~ U(eps, 1); every answer token is masked with
probability t (the prompt never is); the loss is the cross-entropy on masked positions weighted
by 1/t, summed and divided by the number of answer tokens.

    python -m cdlm_serve.train.teacher --out runs/teacher --steps 6000

The run folder holds a checkpoint (model, optimizer, step, RNG) written atomically every
`--ckpt-every` steps, a JSONL log, and at the end an exported LLaDA-format model folder
(`model/`: config.json, model.safetensors, tokenizer.json) that the server loads like a real
LLaDA release. Rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from cdlm_serve.engine.decoding import DLMEngine, DLMParams
from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.config import ModelConfig
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.models.weights import to_checkpoint
from cdlm_serve.train.data import KINDS, Mixture
from cdlm_serve.train.tasks import TASKS, exact_match
from cdlm_serve.train.tokenizer import EOS_ID, MASK_ID, PAD_ID, byte_tokenizer

VOCAB = 264  # 256 bytes + 4 specials, padded to a multiple of 8


@dataclass(slots=True)
class TeacherConfig:
    d_model: int = 256
    layers: int = 6
    heads: int = 4
    mlp: int = 768
    max_len: int = 512

    def hf_config(self) -> dict[str, Any]:
        """A LLaDA release's config.json, for our sizes."""
        return {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "d_model": self.d_model,
            "n_heads": self.heads,
            "n_kv_heads": self.heads,
            "n_layers": self.layers,
            "mlp_hidden_size": self.mlp,
            "vocab_size": VOCAB,
            "embedding_size": VOCAB,
            "weight_tying": False,
            "include_bias": False,
            "activation_type": "silu",
            "block_type": "llama",
            "layer_norm_type": "rms",
            "rms_norm_eps": 1e-5,
            "rope": True,
            "rope_theta": 10000.0,
            "max_sequence_length": self.max_len,
            "mask_token_id": MASK_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "bos_token_id": 257,
        }


def new_model(cfg: dict[str, Any], seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model


def masked_diffusion_loss(
    model: Transformer,
    prompts: Tensor,
    answers: Tensor,
    pattern: AttentionPattern,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
) -> Tensor:
    """LLaDA's loss on a batch of (prompt [B, P], answer [B, A])."""
    batch, ans_len = answers.shape
    t = torch.rand(batch, 1, generator=generator) * (1 - eps) + eps  # [B, 1]
    masked = torch.rand(batch, ans_len, generator=generator) < t  # [B, A]
    noisy = torch.where(masked, MASK_ID, answers)
    hidden = model(torch.cat([prompts, noisy], dim=1), pattern=pattern)
    logits = model.logits(hidden[:, prompts.shape[1] :])  # [B, A, V]
    ce = F.cross_entropy(logits[masked].float(), answers[masked], reduction="none")
    return (ce / t.expand(batch, ans_len)[masked]).sum() / (batch * ans_len)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` next to `path`, fsync, rename over `path`: a reader (or a resumed run) sees
    the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_atomic(obj: Any, path: Path) -> None:
    write_atomic(path, lambda tmp: torch.save(obj, tmp))


def resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    """Load a checkpoint written by `after_step` into the model and the optimizer; the rest of
    its state (step, random generator) is the caller's. None when there is none yet."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    print(f"resumed at step {state['step']}")
    return state


def after_step(
    step: int,
    args: Any,
    record: dict[str, Any],
    log: TextIO,
    model: torch.nn.Module,
    evaluate: Callable[[], dict[str, Any]],
    checkpoint: Callable[[], dict[str, Any]],
    ckpt_path: Path,
) -> None:
    """The bookkeeping after every optimizer step of both training loops (teacher, student):
    evals every `args.eval_every` steps and at the last (0: never), one JSON line per step in
    the log, a resumable checkpoint every `args.ckpt_every` steps and at the last."""
    last = step == args.steps
    if args.eval_every and (step % args.eval_every == 0 or last):
        model.eval()
        record |= evaluate()
        model.train()
        tqdm.write(json.dumps(record))
    log.write(json.dumps(record) + "\n")
    log.flush()
    if step % args.ckpt_every == 0 or last:
        save_atomic(checkpoint(), ckpt_path)


def export_model(
    model: Transformer,
    hf_config: dict[str, Any],
    out: Path,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Write a LLaDA-format folder (config.json, model.safetensors, tokenizer), atomically."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(
        to_checkpoint(sd, model.config), str(tmp / "model.safetensors"), metadata={"format": "pt"}
    )
    (tmp / "config.json").write_text(json.dumps({**hf_config, **(extra_config or {})}, indent=2))
    byte_tokenizer().save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)


@torch.inference_mode()
def task_eval(
    model: Transformer,
    task: str,
    n: int,
    block_size: int = 8,
    decoding: str = "vanilla",
    threshold: float = 0.9,
) -> tuple[float, float]:
    """(exact match %, mean steps per answer) on the first n held-out problems, one token per
    step by default."""
    engine = DLMEngine(model, byte_tokenizer(), model.config.max_position_embeddings, max_batch=32)
    return solve_held_out(engine, task, n, block_size, decoding, threshold)


@torch.inference_mode()
def solve_held_out(
    engine: DLMEngine, task: str, n: int, block_size: int, decoding: str, threshold: float
) -> tuple[float, float]:
    """Decode the first n held-out problems of `task` together on an idle engine ->
    (exact match %, mean steps per answer)."""
    kind = KINDS[task]
    examples = TASKS[task].held_out()[:n]
    params = DLMParams(
        max_tokens=kind.answer_len,
        decoding=decoding,  # type: ignore[arg-type]
        block_size=block_size,
        threshold=threshold,
    )
    for i, ex in enumerate(examples):
        ids = engine.tokenizer.encode(ex.prompt, add_special_tokens=False)
        engine.add(engine.new_sequence(str(i), ids, params))
    answers: dict[str, list[str]] = {}
    steps: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            answers.setdefault(out.request_id, []).append(out.text)
            steps[out.request_id] = out.steps
    correct = sum(exact_match("".join(answers[str(i)]), ex.answer) for i, ex in enumerate(examples))
    return 100.0 * correct / len(examples), sum(steps.values()) / len(examples)


def parse_weights(text: str) -> dict[str, int]:
    """ "addition3=1,trace4=2,prose=1" -> {"addition3": 1, ...} (batches per round)."""
    weights = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if name not in KINDS or not count.isdigit():
            raise ValueError(f"bad --weights entry {part!r}; kinds: {', '.join(KINDS)}")
        weights[name] = int(count)
    return weights


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = out / "ckpt.pt", out / "log.jsonl"
    shape = TeacherConfig(args.d_model, args.layers, args.heads, args.mlp)
    hf_config = shape.hf_config()
    model = new_model(hf_config, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step = 0
    if args.init and not ckpt_path.exists():
        # Weights only: a new run (fresh optimizer and schedule) continuing an earlier one.
        model.load_state_dict(torch.load(args.init, weights_only=False)["model"])
        print(f"initialized from {args.init}")
    if (state := resume(ckpt_path, model, opt)) is not None:
        step = state["step"]
        torch.set_rng_state(state["torch_rng"])
    (out / "train_args.json").write_text(json.dumps(vars(args), indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"teacher: {n_params / 1e6:.2f}M params, {asdict(shape)}")
    mixture = Mixture(
        seed=args.seed + step,
        tokens_per_batch=args.tokens_per_batch,
        weights=parse_weights(args.weights),
    )
    pattern = AttentionPattern.bidirectional()
    bar = tqdm(total=args.steps, initial=step, desc="teacher", unit="step")
    batches = mixture.batches(step)
    started = time.perf_counter()
    with log_path.open("a") as log:
        while step < args.steps:
            kind, prompts, answers = next(batches)
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = masked_diffusion_loss(model, prompts, answers, pattern)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(kind=kind, loss=f"{loss.item():.3f}")
            record = {
                "step": step,
                "kind": kind,
                "loss": round(loss.item(), 4),
                "lr": lr,
                "elapsed_s": round(time.perf_counter() - started, 1),
            }
            after_step(
                step,
                args,
                record,
                log,
                model,
                lambda: {
                    f"em_{task}": task_eval(model, task, args.eval_n)[0]
                    for task in ("addition3", "trace4")
                },
                lambda step=step: {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "step": step,
                    "torch_rng": torch.get_rng_state(),
                },
                ckpt_path,
            )
    bar.close()
    model.eval()
    export_model(model, hf_config, out / "model")
    print(f"exported {out / 'model'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=768)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--tokens-per-batch", type=int, default=8192)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--init", help="start from this run's ckpt.pt (weights only)")
    p.add_argument("--weights", default="addition3=1,trace4=1,prose=1", help="batches per round")
    train(p.parse_args(argv))


if __name__ == "__main__":
    random.seed(0)
    main()
