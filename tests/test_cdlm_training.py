"""CDLM post-training pieces on a tiny teacher: trajectories (exact, resumable), the student's
losses, LoRA, and the student CLI (checkpoint, resume, export that the engine loads)."""

from __future__ import annotations

import json

import pytest
import torch

from cdlm_serve.models.attention import AttentionPattern
from cdlm_serve.models.loading import load_model
from cdlm_serve.train import student as st
from cdlm_serve.train import trajectories as tj
from cdlm_serve.train.data import KINDS, task_batch
from cdlm_serve.train.tasks import TASKS
from cdlm_serve.train.teacher import TeacherConfig, export_model, new_model
from cdlm_serve.train.tokenizer import MASK_ID

BLOCK = 8


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher") / "model"
    cfg = TeacherConfig(d_model=64, layers=2, heads=2, mlp=128).hf_config()
    export_model(new_model(cfg, seed=0), cfg, folder)
    return folder


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    model, _ = load_model(teacher_dir)
    return model.eval()


def _prompts(n: int = 6):
    return task_batch(list(TASKS["addition3"].held_out()[:n]), KINDS["addition3"])


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_trajectory_is_block_wise_one_token_per_step_and_replays_exactly(teacher, temperature):
    prompt, _ = _prompts()
    gen = torch.Generator().manual_seed(0)
    tokens, order, hidden = tj.decode(teacher, prompt, 16, BLOCK, temperature, gen)
    assert (tokens != MASK_ID).all()
    for b in range(2):  # block b is finalized during steps [8b, 8b + 8), one position each
        steps = order[:, b * BLOCK : (b + 1) * BLOCK].sort(-1).values
        assert torch.equal(steps, torch.arange(b * BLOCK, (b + 1) * BLOCK).expand_as(steps))
    traj = tj.Trajectories(prompt, tokens, order, tokens, hidden)
    for step in (0, 5, 11):
        state = traj.state(torch.full((len(prompt),), step))
        x = torch.cat([prompt, state], 1)
        with torch.no_grad():
            h = teacher(x, pattern=AttentionPattern.bidirectional())
        b0 = prompt.shape[1] + (step // BLOCK) * BLOCK
        # The stored hidden states are the teacher's at exactly that state.
        torch.testing.assert_close(hidden[:, step], h[:, b0 : b0 + BLOCK], atol=1e-5, rtol=0)
        if temperature == 0:
            # The finalized position is the most confident masked one, with its argmax token.
            logits = teacher.logits(h[:, b0 : b0 + BLOCK]).float()
            logits[..., MASK_ID] = float("-inf")
            probs = torch.softmax(logits, -1)
            a0 = b0 - prompt.shape[1]  # the block's first answer position
            conf = probs.max(-1).values.masked_fill(state[:, a0 : a0 + BLOCK] != MASK_ID, -1)
            pos = conf.argmax(-1)
            rows = torch.arange(len(prompt))
            assert torch.equal(order[rows, a0 + pos], torch.full_like(pos, step))
            assert torch.equal(tokens[rows, a0 + pos], probs.argmax(-1)[rows, pos])


def test_shards_resume_and_load(teacher_dir, tmp_path):
    argv = [
        "--teacher", str(teacher_dir), "--out", str(tmp_path), "--task-shards", "2",
        "--prose-shards", "1", "--shard-size", "3", "--prose-len", "16", "--dtype", "float32",
    ]  # fmt: skip
    tj.main(argv)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["shards"]) == (2 + 2 + 1) * 2  # kinds x shards x 2 temperatures
    files = sorted(tmp_path.glob("*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in files]
    tj.main(argv)  # everything is done: a rerun writes nothing
    assert [f.stat().st_mtime_ns for f in files] == stamps
    loaded = tj.load(tmp_path)
    assert set(loaded) == {"addition3", "trace4", "prose"}
    add = loaded["addition3"]
    assert add.tokens.shape == (2 * 2 * 3, 40) and add.hidden.shape == (12, 40, BLOCK, 64)
    assert loaded["prose"].tokens.shape == (6, 16)
    assert not any(f.name.endswith(".tmp") for f in tmp_path.iterdir())


def _traj(teacher, n: int = 8) -> tj.Trajectories:
    prompt, truth = _prompts(n)
    gen = torch.Generator().manual_seed(1)
    tokens, order, hidden = tj.decode(teacher, prompt, 40, BLOCK, 0.5, gen)
    return tj.Trajectories(prompt, tokens, order, truth, hidden)


def test_draw_states_are_nested_and_cover_the_block(teacher):
    traj = _traj(teacher)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = st.draw(traj, 8, BLOCK, gen)
        y_masked, star_masked = batch.y == MASK_ID, batch.y_star == MASK_ID
        assert (star_masked <= y_masked).all()  # y* is more complete than y
        assert torch.equal(batch.new, y_masked & ~star_masked) and batch.new.any(-1).all()
        assert torch.equal(batch.still, star_masked)
        assert batch.before.shape[1] % BLOCK == 0 and (batch.before != MASK_ID).all()


def test_losses_vanish_where_they_should(teacher):
    traj = _traj(teacher)
    gen = torch.Generator().manual_seed(0)
    batch = st.draw(traj, 8, BLOCK, gen)
    head = teacher.lm_head.weight.detach()
    terms = st.losses(teacher, head, batch, st.Weights(), gen)
    assert all(torch.isfinite(v) for v in terms.values())
    assert terms["distill"] > 0  # block-causal student vs bidirectional teacher differ
    logp = torch.log_softmax(torch.randn(2, BLOCK, 5), -1)
    assert st.kl(logp, logp, torch.ones(2, BLOCK, dtype=torch.bool)) == 0
    # With the teacher's own hidden states as the target at the same attention, KL is zero.
    hidden = teacher(
        torch.cat([batch.prompt, batch.before, batch.y], 1),
        pattern=AttentionPattern.block_causal(BLOCK, batch.prompt.shape[1]),
    )
    batch.teacher_hidden = hidden[:, -BLOCK:].detach()
    terms = st.losses(teacher, head, batch, st.Weights(1.0, 0.0, 0.0), gen)
    assert terms["distill"].abs() < 1e-5 and terms["consistency"] == 0 and terms["dlm"] == 0


def test_distillation_fits_the_teacher(teacher):
    traj = _traj(teacher)
    student = new_model(TeacherConfig(d_model=64, layers=2, heads=2, mlp=128).hf_config(), 5)
    gen = torch.Generator().manual_seed(0)
    batch = st.draw(traj, 8, BLOCK, gen)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    head = teacher.lm_head.weight.detach()
    history = []
    for _ in range(30):
        loss = st.losses(student, head, batch, st.Weights(1.0, 0.0, 0.0), gen)["total"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    assert history[-1] < 0.5 * history[0]


def test_lora_starts_as_identity_and_merges_exactly(teacher):
    import copy

    model = copy.deepcopy(teacher)
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(x)
    st.add_lora(model, r=4, alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
        adapted = model(x)
        st.merge_lora(model)
        assert not any(isinstance(m, st.LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adapted, before, atol=1e-3)


@pytest.mark.parametrize("lora", ["0", "4"])
def test_student_cli_checkpoints_resumes_and_exports(teacher_dir, tmp_path, lora):
    traj_dir = tmp_path / "traj"
    tj.main([
        "--teacher", str(teacher_dir), "--out", str(traj_dir), "--task-shards", "1",
        "--prose-shards", "1", "--shard-size", "4", "--prose-len", "16", "--dtype", "float32",
        "--temperatures", "0",
    ])  # fmt: skip
    out = tmp_path / "student"
    common = [
        "--teacher", str(teacher_dir), "--traj", str(traj_dir), "--out", str(out),
        "--batch", "4", "--ckpt-every", "2", "--eval-every", "0", "--lora", lora,
    ]  # fmt: skip
    st.main([*common, "--steps", "3"])
    st.main([*common, "--steps", "5"])  # resumes at 3
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert {"distill", "consistency", "dlm", "total"} <= set(log[0])
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["cdlm_block_size"] == BLOCK and config["cdlm_threshold"] == 0.9
    model, ckpt = load_model(out / "model")
    assert ckpt.config.dlm_block_size == BLOCK
    teacher_model, _ = load_model(teacher_dir)
    changed = any(
        not torch.equal(a, b)
        for a, b in zip(
            model.state_dict().values(), teacher_model.state_dict().values(), strict=True
        )
    )
    assert changed  # the student trained
