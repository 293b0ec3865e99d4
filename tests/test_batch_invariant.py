"""Batch-invariant mode (`--batch-invariant`: `ModelRunner.batch_invariant`), in the AR engine
on a tiny but wide Llama in bf16 with the fused CPU kernels, each test on each kernel build this
CPU runs: request R's answer (tokens, each token's logprob and its top 5, compared as floats
with ==) is the same alone, among 7 other requests of 5-700 tokens that join while it prefills
and decodes, after its prefix came from the prefix cache, and continuing a session restored
from disk; greedy and seeded. Without the mode the batch changes the answer (the control: the
comparison can see a difference)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

import tiny_models
from cdlm_serve.engine.decoding.ar_engine import AREngine
from cdlm_serve.engine.decoding.prefix_cache import PrefixCache
from cdlm_serve.engine.decoding.sampling import SamplingParams
from cdlm_serve.engine.sessions.session import Session
from cdlm_serve.engine.sessions.store import SessionStore
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.transformer import Transformer
from conftest import running_server, series_sum
from cpu_features import ISAS, kernel_build

BF16 = torch.bfloat16
# The engine's own default: several prompts' chunks share a step's 512 tokens, so a neighbour
# decides where R's prompt is cut (the server's CPU default, 128, keeps every step fused anyway).
PREFILL_TOKENS = 512
PARAMS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
    "seeded": SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=5),
}

_gen = torch.Generator().manual_seed(0)
R = torch.randint(0, 256, (300,), generator=_gen).tolist()
# The neighbours, by name: (prompt, the step at which it joins). N450 joins with R and takes
# most of the first step's budget, so R's prompt is cut 57 + 243; N700 prefills over the
# steps in which R decodes.
NEIGHBOURS = {
    f"N{n}": (torch.randint(0, 256, (n,), generator=_gen).tolist(), step)
    for n, step in ((5, 0), (450, 0), (700, 1), (40, 2), (200, 3), (9, 4), (130, 5))
}
# A request sharing R's first 256 tokens (16 prefix-cache blocks), then its own.
W = R[:256] + torch.randint(0, 256, (60,), generator=_gen).tolist()


@pytest.fixture(scope="module", autouse=True, params=ISAS)
def isa(request):
    """Each test on each build."""
    with kernel_build(request.param):
        yield request.param


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wide-llama")
    tiny_models.wide_llama(folder)
    return folder


@pytest.fixture(scope="module")
def model(wide_dir) -> Transformer:
    model, _ = load_model(wide_dir, dtype=BF16)
    return model


@dataclass(slots=True)
class Job:
    id: str
    prompt: list[int]
    params: SamplingParams
    step: int = 0  # the engine step at which it joins
    session: Session | None = None
    append: bool = True


@dataclass(slots=True)
class Answer:
    tokens: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]  # each token's, and its top 5
    cached: int = 0  # prompt tokens that came from the prefix cache


def _engine(model: Transformer, invariant: bool, prefix: PrefixCache | None = None) -> AREngine:
    tok = tiny_models.byte_tokenizer()
    return AREngine(model, tok, 2048, 8, PREFILL_TOKENS, prefix, batch_invariant=invariant)


def _run(engine: AREngine, jobs: list[Job]) -> dict[str, Answer]:
    """Each job joins the engine at its step; every answer once all finished."""
    seqs = {
        j.id: engine.new_sequence(j.id, j.prompt, j.params, session=j.session, append=j.append)
        for j in jobs
    }
    answers = {j.id: Answer([], []) for j in jobs}
    step = 0
    while step <= max(j.step for j in jobs) or engine.has_work():
        for j in jobs:
            if j.step == step:
                engine.add(seqs[j.id])
        for out in engine.step():
            a = answers[out.request_id]
            a.tokens += out.token_ids
            a.logprobs += [(lp.logprob, lp.top) for lp in out.logprobs]
            a.cached = out.cached_tokens or a.cached
        step += 1
        assert step < 400, "the engine never finished"
    return answers


def _batch_jobs(params: SamplingParams, r_prompt: list[int] = R) -> list[Job]:
    jobs = [Job(name, prompt, params, step) for name, (prompt, step) in NEIGHBOURS.items()]
    jobs.insert(2, Job("R", r_prompt, params, 0))  # after N5 and N450: they go first
    return jobs


def alone(model: Transformer, params: SamplingParams, invariant: bool = True) -> Answer:
    return _run(_engine(model, invariant), [Job("R", R, params)])["R"]


def in_batch(model: Transformer, params: SamplingParams, invariant: bool = True) -> Answer:
    return _run(_engine(model, invariant), _batch_jobs(params))["R"]


def after_cache_hit(model: Transformer, params: SamplingParams, invariant: bool = True) -> Answer:
    """R alone after W (which shares its first 256 tokens) ran in a batch: R's first 256
    tokens' K/V are W's, computed in other chunks beside other rows."""
    engine = _engine(model, invariant, PrefixCache(64 << 20))
    _run(engine, _batch_jobs(params, W))
    answer = _run(engine, [Job("R", R, params)])["R"]
    assert answer.cached == 256, "R's prefix did not come from the cache"
    return answer


def from_restored_session(
    model: Transformer, params: SamplingParams, folder: Path, invariant: bool = True
) -> Answer:
    """R's first 200 tokens prefilled into a session (in a batch), written to disk, read back
    by a new store (as a restarted server does), then R's other 100 continue it alone."""
    store = SessionStore(folder, 1 << 30)
    session = store.create("wide", "s1")
    engine = _engine(model, invariant)
    prefill = SamplingParams(max_tokens=0)
    jobs = [Job(j.id, j.prompt, prefill, j.step) for j in _batch_jobs(params)]
    jobs[2] = Job("P", R[:200], prefill, 0, session=session)
    _run(engine, jobs)
    store.persist(session)
    restored = SessionStore(folder, 1 << 30).get("s1")
    assert restored is not None and restored.cache is None  # on disk only, until loaded
    cache = SessionStore(folder, 1 << 30).load(restored, model.device, BF16)
    assert cache is not None and cache.lengths == [200] and restored.tokens == R[:200]
    return _run(engine, [Job("R", R[200:], params, session=restored, append=False)])["R"]


_ALONE: dict[tuple[str, str], Answer] = {}


def _alone(model: Transformer, isa: str, kind: str) -> Answer:
    """R's answer alone, in the mode, once per build and params."""
    if (isa, kind) not in _ALONE:
        _ALONE[isa, kind] = alone(model, PARAMS[kind])
    return _ALONE[isa, kind]


SCENARIOS: dict[str, Callable[..., Answer]] = {
    "in_batch": lambda model, params, tmp: in_batch(model, params),
    "after_cache_hit": lambda model, params, tmp: after_cache_hit(model, params),
    "from_restored_session": lambda model, params, tmp: from_restored_session(model, params, tmp),
}


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_answer_is_the_same_bits_alone_and(model, isa, kind, scenario, tmp_path):
    want = _alone(model, isa, kind)
    got = SCENARIOS[scenario](model, PARAMS[kind], tmp_path)
    assert len(want.tokens) == len(want.logprobs) == 12
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs  # floats, bit for bit: ==, no tolerance


def test_a_seeded_answer_is_sampled(model, isa):
    """The seeded cases compare sampled answers, not the greedy one again."""
    assert _alone(model, isa, "seeded").tokens != _alone(model, isa, "greedy").tokens


def test_without_the_mode_a_batch_changes_the_answer(model):
    """The control: without the mode, R's prompt in chunks beside other prompts takes the
    PyTorch path (GEMMs and SDPA whose splits follow the shapes) and its logprobs change; so
    the comparisons above can see a difference, and the mode is what removes it."""
    params = PARAMS["greedy"]
    assert in_batch(model, params, invariant=False) != alone(model, params, invariant=False)


# ---- over HTTP ---------------------------------------------------------------------------------
BODIES = {
    "greedy": {"temperature": 0, "logprobs": 5},
    "seeded": {"temperature": 0.8, "seed": 7, "logprobs": 5},
}


def _complete(base: str, prompt: list[int], body: dict, **extra) -> dict:
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "wide", "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
        | body
        | extra,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _what(response: dict) -> tuple[str, dict]:
    """What must not change: the text and the logprobs (each token's and its top 5, as the
    JSON floats the server wrote)."""
    choice = response["choices"][0]
    return choice["text"], choice["logprobs"]


def _in_concurrent_batch(base: str, body: dict, salt: str) -> dict:
    """R's response, sent with its 7 neighbours all at once (R third)."""
    prompts = [p for p, _ in NEIGHBOURS.values()]
    prompts.insert(2, R)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, base, p, body, cache_salt=salt) for p in prompts]
        return [f.result() for f in futures][2]


def test_over_http_alone_in_a_batch_after_a_cache_hit_and_from_a_restored_session(
    wide_dir, tmp_path
):
    """A server with --batch-invariant (and 512-token prefill steps, where neighbours' prompts
    share R's steps). Each case has a cache salt of its own: R alone and R in the batch start
    with an empty prefix cache; the cache-hit case runs W first. The session is created by one
    server and continued by the next, over the same sessions folder."""
    args = (
        "--model", f"wide={wide_dir}", "--device", "cpu", "--dtype", "bfloat16",
        "--batch-invariant", "--prefill-tokens-per-step", str(PREFILL_TOKENS),
        "--sessions-dir", str(tmp_path), "--max-batch", "8",
    )  # fmt: skip
    want = {}
    with running_server(*args) as base:
        for kind, body in BODIES.items():
            alone = _complete(base, R, body, cache_salt=f"alone-{kind}")
            assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            want[kind] = _what(alone)
            batch = _in_concurrent_batch(base, body, f"batch-{kind}")
            assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert _what(batch) == want[kind], kind
            _complete(base, W, body, cache_salt=f"hit-{kind}")
            hit = _complete(base, R, body, cache_salt=f"hit-{kind}")
            assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
            assert _what(hit) == want[kind], kind
        assert want["seeded"][0] != want["greedy"][0]  # sampled, not the greedy answer again
        r = httpx.post(f"{base}/v1/sessions", json={"model": "wide", "id": "s1", "prompt": R[:200]})
        assert r.status_code == 201, r.text
    with running_server(*args) as base:  # a new process: the session comes from disk
        for kind, body in BODIES.items():
            # A session's completion reports no logprobs (the API refuses them): the text only
            # here; test_an_answer_is_the_same_bits_alone_and compares a session's logprobs.
            extra = {k: v for k, v in body.items() if k != "logprobs"}
            resumed = _complete(base, R[200:], extra, session_id="s1", append=False)
            assert resumed["choices"][0]["text"] == want[kind][0], kind


# ---- the diffusion engine ----------------------------------------------------------------------
DLM = {"cdlm": "cdlm-student", "fast_dllm": "cdlm-teacher", "vanilla": "cdlm-teacher"}


@dataclass(slots=True)
class Decoded:
    text: str
    steps: int
    logits: list[torch.Tensor]  # each step's block logits [B, V] fp32, in order


def _dlm_prompts() -> dict[str, str]:
    """R (a held-out trace problem) and 3 neighbours of other lengths (10-84 bytes)."""
    from cdlm_serve.train.tasks import TASKS

    problems = TASKS["trace4"].held_out()[:4]
    return {
        "a": problems[0].prompt * 2,
        "R": problems[2].prompt,
        "b": problems[1].prompt[:10],
        "c": problems[3].prompt * 3,
    }


def _decode(decoding: str, names: list[str], invariant: bool) -> Decoded:
    """R decoded by a shipped model in bf16 beside the named neighbours: "c" joins at the
    third step, the others together at the first (cdlm admits them in one go). cdlm runs
    blocks of 32, so that 4 rows' passes (up to 64 tokens each) outgrow FUSED_STEP_TOKENS, as
    fast_dllm's refreshes and vanilla's passes (prompt and answer, 26-100 tokens) do."""
    from cdlm_serve.engine.decoding.dlm_engine import DLMEngine, DLMParams
    from cdlm_serve.train.tokenizer import byte_tokenizer

    model = _shipped(DLM[decoding])
    engine = DLMEngine(model, byte_tokenizer(), 512, 8, batch_invariant=invariant)
    logits: list[torch.Tensor] = []
    engine.on_step = lambda seq, block: logits.append(block.clone()) if seq.id == "R" else None
    tokens, block = _dlm_lengths(decoding)
    params = DLMParams(max_tokens=tokens, decoding=decoding, block_size=block, ignore_eos=True)
    prompts = _dlm_prompts()
    seqs = [engine.new_sequence(n, list(prompts[n].encode()), params) for n in names]
    text, steps = "", 0
    for step in range(400):
        for seq in seqs:
            if step == (2 if seq.id == "c" else 0):
                engine.add(seq)
        for out in engine.step():
            if out.request_id == "R":
                text, steps = text + out.text, out.steps
        if step >= 2 and not engine.has_work():
            return Decoded(text, steps, logits)
    raise AssertionError("the engine never finished")


def _dlm_lengths(decoding: str) -> tuple[int, int]:
    """(new tokens, block size): vanilla takes a step per token; cdlm's blocks of 32 make
    several rows' passes outgrow the fused step's 192 tokens without the mode."""
    return 16 if decoding == "vanilla" else 40, 32 if decoding == "cdlm" else 8


_SHIPPED: dict[str, Transformer] = {}


def _shipped(name: str) -> Transformer:
    from cdlm_serve.models.sources import resolve

    if name not in _SHIPPED:
        _SHIPPED[name] = load_model(resolve(name), dtype=BF16)[0]
    return _SHIPPED[name]


def _same(a: Decoded, b: Decoded) -> bool:
    return (
        a.text == b.text
        and a.steps == b.steps
        and len(a.logits) == len(b.logits)
        and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    )


@pytest.mark.parametrize("decoding", DLM)
def test_a_diffusion_answer_is_the_same_bits_alone_and_in_a_batch(decoding):
    """Text, steps and every step's block logits (==) of R alone and beside 3 neighbours."""
    alone = _decode(decoding, ["R"], invariant=True)
    assert alone.steps >= 2 and alone.text
    assert _same(_decode(decoding, ["a", "R", "b", "c"], invariant=True), alone)


@pytest.mark.parametrize("decoding", DLM)
def test_without_the_mode_a_diffusion_batch_changes_the_logits(decoding):
    """The control: without the mode the batch's passes (over 192 tokens together) and cdlm's
    joint admission of ragged prompts take the padded PyTorch path, and R's logits change."""
    alone = _decode(decoding, ["R"], invariant=False)
    assert not _same(_decode(decoding, ["a", "R", "b", "c"], invariant=False), alone)


def _dlm_complete(base: str, decoding: str, prompt: str) -> tuple[str, int, str]:
    """What must not change over HTTP (the diffusion API sends no logprobs): the text, the
    number of denoising steps, and why it stopped."""
    tokens, block = _dlm_lengths(decoding)
    body = {"model": DLM[decoding], "prompt": prompt, "max_tokens": tokens, "block_size": block}
    body |= {"decoding": decoding, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return choice["text"], usage["steps"], choice["finish_reason"]


STEPS = "cdlm_serve:dlm_step_latency_seconds_count"  # batched denoising steps a model ran


def _unsure_prompts() -> list[str]:
    """8 strings of 8-60 random characters: far from the trace problems the models learned, so
    they are unsure, and a small change of the logits changes the text. On trace problems they
    are so sure that a batch without the mode changed no text (0 of 24 problems per decoder),
    while on these it changed 7 of 24 cdlm answers and 3 of 24 fast_dllm ones (the engine, 4
    rows a batch). 8 rows: however the server's steps cut their arrival, their passes soon
    outgrow the 192 tokens a step takes fused without the mode."""
    import random

    rng = random.Random(0)
    chars = "abcdefghij0123456789+-*= "
    return ["".join(rng.choice(chars) for _ in range(rng.randint(8, 60))) for _ in range(8)]


def test_over_http_each_diffusion_decoder_answers_alike_alone_and_in_a_batch():
    """The shipped diffusion models in bf16 behind a --batch-invariant server, per decoder:
    8 prompts, each sent alone, then all 8 at once; each answer (text, steps, finish reason)
    the same both ways. The engine tests above compare the block logits; this one holds the
    answers through the scheduler, the batch the server forms and the text the route sends."""
    args = ("--model", "cdlm-student", "--model", "cdlm-teacher", "--device", "cpu")
    prompts = _unsure_prompts()
    with running_server(*args, "--dtype", "bfloat16", "--batch-invariant") as base:
        for decoding in DLM:
            alone = [_dlm_complete(base, decoding, p) for p in prompts]
            assert all(a[0] and a[1] >= 2 for a in alone), alone
            engine_steps = series_sum(base, STEPS, f'model_name="{DLM[decoding]}"')
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(partial(_dlm_complete, base, decoding), prompts))
            assert answers == alone, decoding
            # They were decoded together: the engine took fewer steps than the answers did.
            engine_steps = series_sum(base, STEPS, f'model_name="{DLM[decoding]}"') - engine_steps
            assert engine_steps < sum(a[1] for a in answers), decoding
