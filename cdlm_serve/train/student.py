"""Train the CDLM student from the teacher's trajectories.

The student starts as a copy of the teacher and runs block-causal attention (the prompt is one
bidirectional block, then answer blocks of B: bidirectional inside a block, causal across), so
at inference each finished block's K/V is cached exactly. Each training step draws one kind, one
block index b for the batch, and per row two steps of the teacher's trajectory inside block b,
t < t*: the intermediate state y (before step t) and a more complete state y* (before t*). The
blocks after b are dropped: under block-causal attention they cannot change block b.

    L = w_d * KL_distill + w_c * KL_consistency + w_dlm * L_DLM

- distillation: KL(teacher || student(y)) on the positions newly unmasked between y and y*
  (the positions the student must learn to finalize together in one step); the teacher's
  distribution is its recorded hidden state at y, rebuilt through the teacher's lm_head.
- consistency: KL(stop-grad student(y*) || student(y)) on the positions still masked in y*.
  The block-complete state itself has no masked position left to compare, so y* is drawn among
  the states that still have one; t* = B (the complete block) leaves only the distillation.
- DLM: LLaDA's masked-diffusion cross-entropy on the ground truth, same block-causal layout
  (earlier blocks clean, block b masked with ratio u ~ U(0, 1), weighted 1/u).

Defaults (1.0, 0.5, 0.01) are Dream's in the paper; `--lora R` trains rank-R adapters on the
attention and MLP projections (what the paper does at 7B) and merges them on export.

    python -m cdlm_serve.train.student --teacher runs/teacher/model --traj runs/traj \
        --out runs/student
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.train.teacher import (
    after_step,
    export_model,
    lr_at,
    parse_weights,
    resume,
    task_eval,
)
from cdlm_serve.train.tokenizer import MASK_ID
from cdlm_serve.train.trajectories import Trajectories, load

LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Weights:
    distill: float = 1.0
    consistency: float = 0.5
    dlm: float = 0.01


@dataclass(slots=True)
class Batch:
    """One training batch of one kind, for block b."""

    prompt: Tensor  # [N, P]
    before: Tensor  # [N, b*B] finished blocks (the teacher's tokens)
    y: Tensor  # [N, B] block b at the intermediate state
    y_star: Tensor  # [N, B] block b at the more complete state
    new: Tensor  # bool [N, B] finalized between y and y*
    still: Tensor  # bool [N, B] still masked in y*
    teacher_hidden: Tensor  # [N, B, d] the teacher's last hidden states at y
    truth_before: Tensor  # [N, b*B] ground truth, for L_DLM
    truth_block: Tensor  # [N, B]


def draw(
    traj: Trajectories, n: int, block: int, gen: torch.Generator, device: str = "cpu"
) -> Batch:
    """A batch of n rows, one block index for all, (t, t*) per row (drawn on the CPU, where
    the trajectories live, then moved to `device`)."""
    rows = torch.randint(len(traj.tokens), (n,), generator=gen)
    length = traj.tokens.shape[1]
    b = int(torch.randint(length // block, (1,), generator=gen))
    lo, hi = b * block, (b + 1) * block  # the block's answer positions, and its steps too
    # t in [0, B): at least one position masked in y; t* in (t, B].
    t = torch.randint(block, (n,), generator=gen)
    t_star = t + 1 + (torch.rand(n, generator=gen) * (block - t)).long()
    order = traj.order[rows, lo:hi]  # [N, B] step at which each position was finalized
    tokens = traj.tokens[rows, lo:hi]
    y_mask = order >= (lo + t)[:, None]
    star_mask = order >= (lo + t_star)[:, None]
    batch = Batch(
        prompt=traj.prompt[rows],
        before=traj.tokens[rows, :lo],
        y=torch.where(y_mask, MASK_ID, tokens),
        y_star=torch.where(star_mask, MASK_ID, tokens),
        new=y_mask & ~star_mask,
        still=star_mask,
        teacher_hidden=traj.hidden[rows, lo + t].float(),  # [N, B, d]
        truth_before=traj.truth[rows, :lo],
        truth_block=traj.truth[rows, lo:hi],
    )
    for name in Batch.__slots__:
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def block_logits(model: Transformer, prompt: Tensor, before: Tensor, block: Tensor) -> Tensor:
    """Student logits over the last block [N, B, V], under block-causal attention."""
    x = torch.cat([prompt, before, block], dim=1)
    pattern = AttentionPattern.block_causal(block.shape[1], prompt.shape[1])
    hidden = model(x, pattern=pattern)[:, -block.shape[1] :]
    return model.logits(hidden).float()


def kl(target_logp: Tensor, logp: Tensor, where: Tensor) -> Tensor:
    """Mean over `where` positions of KL(target || model); 0 when there are none."""
    per = (target_logp.exp() * (target_logp - logp)).sum(-1)  # [N, B]
    count = where.sum()
    return (per * where).sum() / count.clamp(min=1)


def losses(
    student: Transformer,
    teacher_head: Tensor,
    batch: Batch,
    weights: Weights,
    gen: torch.Generator,
) -> dict[str, Tensor]:
    logits = block_logits(student, batch.prompt, batch.before, batch.y)
    logp = torch.log_softmax(logits, -1)
    out: dict[str, Tensor] = {}
    teacher_logp = torch.log_softmax(batch.teacher_hidden @ teacher_head.T, -1)
    out["distill"] = kl(teacher_logp, logp, batch.new)
    if weights.consistency:
        with torch.no_grad():
            star = block_logits(student, batch.prompt, batch.before, batch.y_star)
        out["consistency"] = kl(torch.log_softmax(star, -1), logp, batch.still)
    else:
        out["consistency"] = torch.zeros(())
    if weights.dlm:
        n, size = batch.truth_block.shape
        u = (torch.rand(n, 1, generator=gen) * (1 - 1e-3) + 1e-3).to(batch.y.device)  # [N, 1]
        masked = torch.rand(n, size, generator=gen).to(batch.y.device) < u
        noisy = torch.where(masked, MASK_ID, batch.truth_block)
        dlm_logits = block_logits(student, batch.prompt, batch.truth_before, noisy)
        ce = F.cross_entropy(dlm_logits[masked], batch.truth_block[masked], reduction="none")
        out["dlm"] = (ce / u.expand(n, size)[masked]).sum() / (n * size)
    else:
        out["dlm"] = torch.zeros(())
    out["total"] = (
        weights.distill * out["distill"]
        + weights.consistency * out["consistency"]
        + weights.dlm * out["dlm"]
    )
    return out


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: W x + (alpha / r) B A x."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / r
        kw = {"device": base.weight.device}
        a = torch.randn(r, base.in_features, **kw) / math.sqrt(base.in_features)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **kw))  # starts as identity

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += self.scale * self.lora_B @ self.lora_A
        return self.base


def add_lora(model: Transformer, r: int, alpha: float) -> None:
    """Freeze everything, then wrap the attention and MLP projections with adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for name in LORA_TARGETS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha))


def merge_lora(model: Transformer) -> None:
    for module in list(model.modules()):
        for name in LORA_TARGETS:
            child = getattr(module, name, None)
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = out / "ckpt.pt", out / "log.jsonl"
    weights = Weights(args.w_distill, args.w_consistency, args.w_dlm)
    teacher, _ = load_model(Path(args.teacher), args.device, torch.float32)
    hf_config = json.loads((Path(args.teacher) / "config.json").read_text())
    head = teacher.lm_head if teacher.lm_head is not None else teacher.embed_tokens  # tied
    teacher_head = head.weight.detach().clone()
    student = copy.deepcopy(teacher)
    del teacher
    if args.init and not ckpt_path.exists():  # before LoRA wraps (and renames) the layers
        # Weights only (fresh optimizer and schedule): continue an earlier student run.
        if Path(args.init).is_dir():  # an exported model folder (e.g. a shipped snapshot)
            start, _ = load_model(Path(args.init), args.device, torch.float32)
            state = start.state_dict()
        else:
            state = torch.load(args.init, weights_only=False)["model"]
        student.load_state_dict(state)
        print(f"initialized from {args.init}")
    if args.lora:
        add_lora(student, args.lora, args.lora_alpha or 2 * args.lora)
    else:
        student.requires_grad_(True)  # loaded models come frozen, for inference
    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    gen = torch.Generator().manual_seed(args.seed)
    if (state := resume(ckpt_path, student, opt)) is not None:
        step = state["step"]
        gen.set_state(state["gen"])
    (out / "train_args.json").write_text(json.dumps(vars(args), indent=2))
    traj = load(Path(args.traj))
    mix = parse_weights(args.mix)
    schedule = [k for k, w in mix.items() if k in traj for _ in range(w)]
    if not schedule:
        raise SystemExit(f"no trajectories for {list(mix)} in {args.traj}")
    block = int(json.loads((Path(args.traj) / "manifest.json").read_text())["block"])
    print(
        f"student: {sum(p.numel() for p in params) / 1e6:.2f}M trainable, weights {weights}, "
        f"block {block}, trajectories { ({k: len(v.tokens) for k, v in traj.items()}) }"
    )
    bar = tqdm(total=args.steps, initial=step, desc="student", unit="step")
    started = time.perf_counter()
    with log_path.open("a") as log:
        while step < args.steps:
            kind = schedule[step % len(schedule)]
            batch = draw(traj[kind], args.batch, block, gen, args.device)
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            device_type = torch.device(args.device).type
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.bf16):
                terms = losses(student, teacher_head, batch, weights, gen)
            opt.zero_grad(set_to_none=True)
            terms["total"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(kind=kind, loss=f"{terms['total'].item():.3f}")
            record = {"step": step, "kind": kind, "lr": lr}
            record |= {k: round(v.item(), 5) for k, v in terms.items()}
            record["elapsed_s"] = round(time.perf_counter() - started, 1)
            after_step(
                step,
                args,
                record,
                log,
                student,
                lambda: evaluate(student, args, block),
                lambda step=step: {
                    "model": student.state_dict(),
                    "optim": opt.state_dict(),
                    "step": step,
                    "gen": gen.get_state(),
                },
                ckpt_path,
            )
    bar.close()
    if args.lora:
        merge_lora(student)
    student.eval()
    extra = {"cdlm_block_size": block, "cdlm_threshold": args.threshold}
    export_model(student, hf_config, out / "model", extra)
    print(f"exported {out / 'model'}")


def evaluate(student: Transformer, args: Any, block: int) -> dict[str, Any]:
    """Exact match and task steps of the student's cdlm decoding on the held-out tasks."""
    record: dict[str, Any] = {}
    for task in ("addition3", "trace4"):
        em, steps = task_eval(student, task, args.eval_n, block, "cdlm", args.threshold)
        record[f"em_{task}"], record[f"steps_{task}"] = em, round(steps, 2)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the teacher's model folder")
    p.add_argument("--traj", required=True, help="the trajectories folder")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64, help="rows per step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--w-distill", type=float, default=1.0)
    p.add_argument("--w-consistency", type=float, default=0.5)
    p.add_argument("--w-dlm", type=float, default=0.01)
    p.add_argument("--mix", default="addition3=1,trace4=1,prose=1", help="batches per round")
    p.add_argument(
        "--init", help="start from a student run's ckpt.pt or a model folder (weights only)"
    )
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: train all weights)")
    p.add_argument("--lora-alpha", type=float, default=0.0, help="default 2 * rank")
    p.add_argument("--threshold", type=float, default=0.9, help="tau for eval and the export")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=50)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
