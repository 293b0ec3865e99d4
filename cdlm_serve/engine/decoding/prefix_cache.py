"""Automatic prefix caching, with vLLM's semantics: the KV of every full block of
`BLOCK_TOKENS` tokens a sequence ran is kept, keyed by a hash of the whole token prefix up to
the block's end, and any later sequence whose prompt starts with the same tokens loads those
blocks into its row instead of prefilling them again (a shared system prompt, few-shot
examples, the earlier turns of a chat).

Keys chain: block i's key is sha256(key of block i-1, the ids of block i), so a key names its
whole prefix and two prompts share a block only if they agree on every token before it
(sha256, not Python's hash: a crafted prompt must not be able to collide with another's
prefix). Blocks are copies (the batch cache is not paged): loading one copies its slots into
the row, so evicting a block never touches a running sequence.

Eviction is LRU under a byte budget. A chain is touched deepest block first, so within a
chain the root is the most recently used: the leaves go first, and a cached block's parents
are (almost) always cached too.

Only rows whose slots are exactly their tokens at positions 0..n-1 take part: no session
continuation (its row starts from the session's, maybe compacted, cache).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from cdlm_serve.models.kv_cache import KVCache

BLOCK_TOKENS = 16  # vLLM's default block size


def block_hashes(
    tokens: Sequence[int], block: int = BLOCK_TOKENS, salt: str | None = None
) -> list[bytes]:
    """One key per full block of `tokens`: key i names tokens[: (i + 1) * block] (and the
    salt: keys of different salts never meet)."""
    keys: list[bytes] = []
    parent = b"" if salt is None else hashlib.sha256(b"salt\0" + salt.encode()).digest()
    for start in range(0, len(tokens) - block + 1, block):
        digest = hashlib.sha256(parent)
        digest.update(array("q", tokens[start : start + block]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, capacity_bytes: int, block: int = BLOCK_TOKENS):
        if capacity_bytes < 0 or block < 1:
            raise ValueError("the prefix cache needs capacity_bytes >= 0 and block >= 1")
        self.capacity_bytes = capacity_bytes
        self.block = block
        # key -> [L, 2 (K, V), Hkv, block, D]; first = least recently used
        self.blocks: OrderedDict[bytes, Tensor] = OrderedDict()
        self.nbytes = 0
        # vLLM's counters, in tokens: prompt tokens looked up, and those found cached.
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0

    # ---- reuse ---------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str | None = None) -> list[Tensor]:
        """The cached blocks of the longest cached prefix of `tokens` (under `salt`), in
        order. The last token is never matched: it must run, its logits give the first answer
        token."""
        keys = block_hashes(tokens[: len(tokens) - 1], self.block, salt)
        found: list[Tensor] = []
        for key in keys:
            kv = self.blocks.get(key)
            if kv is None:
                break
            found.append(kv)
        for key in reversed(keys[: len(found)]):  # deepest first: the root ends most recent
            self.blocks.move_to_end(key)
        self.queries += len(tokens)
        self.hits += len(found) * self.block
        return found

    @staticmethod
    def load(blocks: list[Tensor], cache: KVCache, row: int) -> int:
        """Copy `blocks` (from `match`) into `row` of `cache` as its first committed slots;
        returns their number. The cache must have room."""
        if not blocks:
            cache.reset(row)
            return 0
        kv = torch.cat(blocks, dim=3)[:, :, None]  # [L, 2, 1, Hkv, n, D]: a batch-1 cache
        n = kv.shape[4]
        cache.load_row(row, KVCache(list(kv[:, 0]), list(kv[:, 1]), [n], [n]))
        return n

    # ---- filling -------------------------------------------------------------------------
    def insert(
        self, tokens: Sequence[int], cache: KVCache, row: int, salt: str | None = None
    ) -> None:
        """Keep the full blocks of `tokens` (under `salt`) not cached yet; `row` of `cache`
        holds their K/V at slots [0, len(tokens)) (RoPE positions equal to slots: no
        compacted segment)."""
        if self.capacity_bytes == 0:
            return
        if cache.lengths[row] < len(tokens) or cache.logical[row] != cache.lengths[row]:
            raise ValueError("the row does not hold these tokens at their own positions")
        keys = block_hashes(tokens, self.block, salt)
        missing = [i for i, key in enumerate(keys) if key not in self.blocks]
        if not missing:
            return
        first, end = missing[0] * self.block, len(keys) * self.block
        kv = torch.stack(
            [
                torch.stack(
                    (cache.keys[layer][row, :, first:end], cache.values[layer][row, :, first:end])
                )
                for layer in range(cache.num_layers)
            ]
        )  # [L, 2, Hkv, end - first, D]
        for i in missing:
            start = i * self.block - first
            block = kv[:, :, :, start : start + self.block].clone()
            self.blocks[keys[i]] = block
            self.nbytes += block.numel() * block.element_size()
        for key in reversed(keys):  # deepest first: the root ends most recent
            self.blocks.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.capacity_bytes and self.blocks:
            _, kv = self.blocks.popitem(last=False)
            self.nbytes -= kv.numel() * kv.element_size()
