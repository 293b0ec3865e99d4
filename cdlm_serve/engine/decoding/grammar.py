"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a choice among
strings, a Lark or GBNF grammar) that an autoregressive answer must follow, token by token.

The grammar engine is llguidance (Microsoft's, also behind vLLM's and llama.cpp's structured
outputs; a Rust library without dependencies: `docs/api.md` says why it and not xgrammar). A
model's `Grammars` holds its tokenizer as llguidance sees it (built once) and the requests'
compiled grammars (least recently used first out); each request gets its own copy of the
compiled matcher (`matcher`), which the engine advances with every token it samples. At each
step the rows that follow a grammar get their masks of allowed tokens together
(`next_token_bitmasks`: llguidance fills them in parallel, beside the forward pass in
`MaskFill`), added to their logits as 0 or -inf (`token_bans`); a row without one pays nothing.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.numpy
import torch
from torch import Tensor

from cdlm_serve.engine import limits

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
MAX_CACHED = 256  # compiled grammars a model keeps (each a few KB to a few MB)
_ANY_OBJECT = '{"type": "object"}'
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): llguidance's default
# allows any run of whitespace between tokens, where a model can loop on newlines until its
# budget ends (a known failure of grammar-constrained JSON). A schema's own "x-guidance"
# options still apply over these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile (the server answers 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's answer must follow. `source`: the JSON schema as JSON text, the
    regex, the choices as a JSON list, or the grammar (Lark, or GBNF when it uses `::=`; for
    "lark", the server's own grammars of tool calls, Lark only); `param`: the request field
    it came from (an error names it)."""

    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

    def grammar(self) -> str:
        """llguidance's grammar for it (ValueError where the source is not valid)."""
        match self.kind:
            case "json_schema":
                return str(_from_schema(self.source, defaults=JSON_OPTIONS))
            case "json_object":
                return str(_from_schema(_ANY_OBJECT, defaults=JSON_OPTIONS))
            case "regex":
                return str(llguidance.LLMatcher.grammar_from_regex(self.source))
            case "choice":
                choices = json.loads(self.source)
                pattern = "|".join(re.escape(c) for c in choices)
                return str(llguidance.LLMatcher.grammar_from_regex(pattern))
            case "grammar":
                # Lark as it is; GBNF (llama.cpp's, vLLM's EBNF) translated to it.
                lark = llguidance.gbnf_to_lark.any_to_lark(self.source)
                return str(llguidance.LLMatcher.grammar_from_lark(lark))
            case "lark":  # ours (tool calls): Lark as it is, never read as GBNF
                return str(llguidance.LLMatcher.grammar_from_lark(self.source))


_from_schema: Any = llguidance.LLMatcher.grammar_from_json_schema  # its options: a TypedDict


class Grammars:
    """One model's grammars: its tokenizer for llguidance, and a cache of compiled ones. From
    any thread: the server builds the tokenizer while it loads the model (`prepare`: ~0.4 s
    for SmolLM2, which would otherwise hold the event loop at the first grammar), the planner
    compiles a new grammar on the event loop (`Engine.params`, when a choice is planned: ~1 ms
    for a nested schema; llguidance builds its lexer lazily, as tokens come), and the engine
    thread only advances the matchers it was handed."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for metrics and benches
        self.compile_seconds = 0.0

    def prepare(self) -> None:
        """Build the tokenizer for llguidance now (the server does while it loads a model)."""
        with self._lock:
            self._ll_tokenizer()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:  # ~1 s for a 50K vocabulary: only once a grammar is asked for
            self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size)
        return self._ll

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one answer (a copy of the cached compiled grammar)."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached.deep_copy()
            started = time.perf_counter()
            try:
                grammar = spec.grammar()
            except (ValueError, TypeError) as e:  # a bad schema, regex, choice list or grammar
                raise GrammarError(f"{spec.param}: {e}", spec.param) from None
            compiled = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
            if compiled.is_error():
                raise GrammarError(f"{spec.param}: {compiled.get_error()}", spec.param)
            self.compiled += 1
            self.compile_seconds += time.perf_counter() - started
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return compiled.deep_copy()

    def for_request(self, spec: GrammarSpec | None) -> llguidance.LLMatcher | None:
        """A request's own matcher for its grammar, or None where it has none; a grammar that
        does not compile is the request's LimitError (a 400 naming the field it came from)."""
        if spec is None:
            return None
        try:
            return self.matcher(spec)
        except GrammarError as e:
            raise limits.LimitError(limits.LimitProblem(str(e), e.param)) from None


def next_token_bitmasks(matchers: list[Any], vocab: int) -> Tensor:
    """Each matcher's tokens allowed next, as llguidance's bitmask [len(matchers), ceil(V/32)]
    int32 on the CPU (bit b of word w: token 32w + b), filled together on llguidance's
    threads (without the GIL: `MaskFill` runs it beside the forward pass). Through llguidance's
    numpy helpers: its torch module compiles a kernel with `torch.compile` when imported, which
    loads dynamo and inductor (~4 s of every server start) for a function this never calls."""
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab)  # [k, W]
    if len(matchers) == 1:
        llguidance.numpy.fill_next_token_bitmask(matchers[0], bitmask)
    else:
        llguidance.numpy.fill_next_token_bitmask_par(
            _executor(), [(m, i) for i, m in enumerate(matchers)], bitmask
        )
    return torch.from_numpy(bitmask)  # the same memory


def allowed_tokens(matchers: list[Any], vocab: int, device: torch.device) -> Tensor:
    """Each matcher's tokens allowed next, as a bool mask [len(matchers), vocab] on `device`."""
    return token_bans(next_token_bitmasks(matchers, vocab), vocab, device) == 0


def token_bans(bitmask: Tensor, vocab: int, device: torch.device) -> Tensor:
    """A bitmask [k, W] (`next_token_bitmasks`) as what to add to the rows' logits: [k, vocab]
    float32 on `device`, 0 where a token is allowed and -inf where it is not. Each byte of the
    mask looks its 8 tokens up in a table (an embedding of the 256 bytes): ~6x less than
    unpacking the bits and `masked_fill` (2.4 ms for 8 rows of a 49K vocabulary on a core)."""
    k = bitmask.shape[0]
    bytes_ = bitmask.to(device, non_blocking=True).view(torch.uint8).long()  # [k, 4W]
    # Little-endian (x86, CUDA): byte i of a row holds the bits of tokens 8i .. 8i + 7.
    bans = torch.nn.functional.embedding(bytes_, _byte_bans(device))  # [k, 4W, 8]
    return bans.view(k, -1)[:, :vocab]


_BYTE_BANS: dict[torch.device, Tensor] = {}


def _byte_bans(device: torch.device) -> Tensor:
    """[256, 8] float32: for each byte value, its 8 bits as 0 (set: allowed) or -inf."""
    table = _BYTE_BANS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
        _BYTE_BANS[device] = table
    return table


class MaskFill:
    """The masks of a step's rows that follow a grammar, filled on a worker thread while the
    model's forward pass runs (each matcher is where the last token left it: its mask does
    not depend on this step's logits). llguidance fills without the GIL, so on a GPU the mask
    costs nothing beside the forward; on a CPU the two share the cores."""

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, matchers: list[Any], vocab: int):
        self._future: Future[Tensor] | None = None
        if matchers:
            self._future = self._worker().submit(next_token_bitmasks, matchers, vocab)

    @classmethod
    def _worker(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            return cls._pool

    def bans(self, vocab: int, device: torch.device) -> Tensor:
        """token_bans of the matchers it was given, [k, vocab] (waits for the fill)."""
        assert self._future is not None, "no matchers were given"
        return token_bans(self._future.result(), vocab, device)

    def wait(self) -> None:
        """Wait for the fill (before any matcher advances), whatever happened meanwhile."""
        if self._future is not None:
            self._future.exception()


_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR
