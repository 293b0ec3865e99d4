"""Teacher trajectories for CDLM post-training.

The teacher (bidirectional: prompt + the whole answer, future blocks still masked) decodes each
training prompt block by block with the student's block size B, one token per step: the most
confident masked position of the current block, as vanilla decoding does. At temperature 0 the
token is the argmax; above it, the token is sampled at that temperature (its probability is
still the confidence), so temperature changes both the tokens and the order they are finalized
in.

A trajectory is stored exactly and compactly:
- `tokens` [L]: the final answer; `order` [L]: the step at which each position was finalized.
  The state before step s is `tokens where order < s, else mask`, so no per-step copies.
- `hidden` [L, B, d] (fp16): at step s, the teacher's last hidden states over the current
  block. Logits are rebuilt through the teacher's `lm_head` when training (d = 256 numbers per
  position instead of a 264-wide logit row; ~30x less at real vocabularies).
- `truth` [L]: the ground-truth answer (EOS-padded task answer or the real prose), for L_DLM.
- `prompt` [P].

Shards are safetensors files, one per (kind, temperature, index), each written atomically;
`manifest.json` lists the finished ones, so a rerun resumes where the last one stopped.

    python -m cdlm_serve.train.trajectories --teacher runs/teacher/model --out runs/traj
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.transformer import Transformer
from cdlm_serve.train.data import BLOCK, KINDS, TRAIN_NOVELS, Kind, ProseWindows, task_batch
from cdlm_serve.train.tasks import TASKS
from cdlm_serve.train.teacher import write_atomic
from cdlm_serve.train.tokenizer import MASK_ID


@dataclass(frozen=True, slots=True)
class Trajectories:
    """A batch of trajectories of one kind: prompt [N, P], tokens/order/truth [N, L],
    hidden [N, L, B, d]."""

    prompt: Tensor
    tokens: Tensor
    order: Tensor
    truth: Tensor
    hidden: Tensor

    def state(self, step: Tensor) -> Tensor:
        """The answer before step `step` [N] (or [N, 1]): finalized tokens, mask elsewhere."""
        done = self.order < step.view(-1, 1)
        return torch.where(done, self.tokens, MASK_ID)


@torch.inference_mode()
def decode(
    model: Transformer,
    prompt: Tensor,
    answer_len: int,
    block: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Vanilla block-wise decoding, one token per step, recording the trajectory.

    prompt [N, P] -> tokens [N, L], order [N, L], hidden [N, L, B, d] (model dtype).
    """
    device = model.device
    prompt = prompt.to(device)
    n, p = prompt.shape
    if answer_len % block:
        raise ValueError(f"answer length {answer_len} is not a whole number of blocks of {block}")
    x = torch.cat([prompt, torch.full((n, answer_len), MASK_ID, device=device)], 1)  # [N, P + L]
    order = torch.full((n, answer_len), -1, dtype=torch.long, device=device)
    shape = (n, answer_len, block, model.config.hidden_size)
    hidden_out = torch.empty(shape, dtype=model.dtype, device=device)
    rows = torch.arange(n, device=device)
    pattern = AttentionPattern.bidirectional()
    for step in range(answer_len):
        b0 = p + (step // block) * block  # the current block's first position
        hidden = model(x, pattern=pattern)[:, b0 : b0 + block]  # [N, B, d]
        hidden_out[:, step] = hidden
        logits = model.logits(hidden).float()  # [N, B, V]
        logits[..., MASK_ID] = float("-inf")  # never "decode" the mask token itself
        probs = torch.softmax(logits, dim=-1)  # [N, B, V]
        if temperature > 0:
            hot = torch.softmax(logits / temperature, dim=-1).view(-1, logits.shape[-1])
            token = torch.multinomial(hot, 1, generator=generator).view(n, block)
        else:
            token = probs.argmax(-1)  # [N, B]
        # Confidence is the token's probability at temperature 1 (LLaDA's low-confidence
        # remasking), so hot sampling changes which token, not how sure the model was of it.
        conf = probs.gather(-1, token[..., None])[..., 0]  # [N, B]
        conf = torch.where(x[:, b0 : b0 + block] == MASK_ID, conf, -1.0)
        pos = conf.argmax(-1)  # [N]: the most confident masked position of the block
        x[rows, b0 + pos] = token[rows, pos]
        order[rows, b0 - p + pos] = step
    return x[:, p:].clone(), order, hidden_out


def _prompts(kind: Kind, n: int, shard: int, seed: int) -> tuple[Tensor, Tensor]:
    """Training prompts and ground truths for one shard (deterministic per shard)."""
    if kind.name == "prose":
        windows = ProseWindows(TRAIN_NOVELS, kind, seed=seed * 100_003 + shard)
        return windows.batch(n)
    stream = TASKS[kind.name].train_stream(seed * 100_003 + shard)
    return task_batch([next(stream) for _ in range(n)], kind)


def answer_len(kind: Kind, prose_len: int) -> int:
    return prose_len if kind.name == "prose" else kind.answer_len


def write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, str(tmp)))


def write_manifest(out: Path, manifest: dict) -> None:
    write_atomic(out / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=2)))


def read_manifest(out: Path) -> dict:
    path = out / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {"shards": []}


def generate(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(Path(args.teacher), args.device, getattr(torch, args.dtype))
    model.eval()
    manifest = read_manifest(out)
    manifest.update(teacher=str(args.teacher), block=args.block, prose_len=args.prose_len)
    done = {s["file"] for s in manifest["shards"]}
    jobs = [
        (kind, temp, shard)
        for kind, count in _counts(args).items()
        for temp in args.temperatures
        for shard in range(count)
    ]
    bar = tqdm(total=len(jobs), desc="trajectories", unit="shard")
    for kind_name, temp, shard in jobs:
        name = f"{kind_name}-t{temp:g}-{shard:04d}.safetensors"
        bar.update(1)
        if name in done:
            continue
        kind = KINDS[kind_name]
        prompt, truth = _prompts(kind, args.shard_size, shard, args.seed)
        length = answer_len(kind, args.prose_len)
        truth = truth[:, :length]
        gen = torch.Generator(model.device).manual_seed(zlib.crc32(f"{name}-{args.seed}".encode()))
        started = time.perf_counter()
        tokens, order, hidden = decode(model, prompt, length, args.block, temp, gen)
        write_shard(
            out / name,
            {
                "prompt": prompt,
                "tokens": tokens.cpu(),
                "order": order.cpu(),
                "truth": truth,
                "hidden": hidden.to(torch.float16).cpu(),
            },
        )
        manifest["shards"].append(
            {
                "file": name,
                "kind": kind_name,
                "temperature": temp,
                "n": len(prompt),
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        write_manifest(out, manifest)
    bar.close()
    write_manifest(out, manifest)


def _counts(args: argparse.Namespace) -> dict[str, int]:
    """Shards per kind."""
    return {"addition3": args.task_shards, "trace4": args.task_shards, "prose": args.prose_shards}


def load(out: Path) -> dict[str, Trajectories]:
    """All finished shards, concatenated per kind."""
    manifest = read_manifest(out)
    parts: dict[str, list[dict[str, Tensor]]] = {}
    for shard in manifest["shards"]:
        parts.setdefault(shard["kind"], []).append(load_file(str(out / shard["file"])))
    return {
        kind: Trajectories(**{k: torch.cat([s[k] for s in shards]) for k in Trajectories.__slots__})
        for kind, shards in parts.items()
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the teacher's model folder")
    p.add_argument("--out", required=True)
    p.add_argument("--block", type=int, default=BLOCK, help="the student's block size")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--task-shards", type=int, default=8, help="shards per task and temperature")
    p.add_argument("--prose-shards", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=128, help="prompts per shard")
    p.add_argument("--prose-len", type=int, default=64, help="answer tokens per prose prompt")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    generate(p.parse_args(argv))


if __name__ == "__main__":
    main()
