"""Prefix reuse at the coordinator: which token histories a route's stages still hold.

A generation that ends leaves its KV on every stage of the route (worker
--prefix-cache-sessions keeps finished sessions, least recently used out first). The route
remembers the token history each finished generation left there; a new generation whose prompt
starts with one of them asks every stage to start from it (CacheExpectation.reuse with that
prefix's n_past and prefix hash) and prefills only the rest. Each stage checks the prefix hash
against what its own KV holds: a stage that evicted the entry, restarted, or holds another
history refuses with FAILED_PRECONDITION, and the route prefills from n_past 0. The index is a
hint; the stages' hashes are the truth.

An entry is taken while a generation uses it (each stage moves its kept session into the new
one) and the longer history goes back in when that generation ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# a shared prefix shorter than this is not worth reusing: it saves little prefill, and the entry
# is better left for a prompt that shares more of it
MIN_REUSE = 8


@dataclass
class PrefixIndex:
    capacity: int = 64  # histories remembered (the stages keep at most max_sessions each)
    min_tokens: int = MIN_REUSE
    _entries: OrderedDict[int, np.ndarray] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 0

    def take(self, prompt: Sequence[int]) -> int:
        """The longest remembered history the prompt starts with, as the n_past to reuse (at
        most len(prompt) - 1: the last prompt token is computed for its logits), taken out of
        the index; 0 where none shares min_tokens."""
        want = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            best, best_key = 0, None
            for key, held in self._entries.items():
                n = min(len(held), len(want) - 1)
                if n < max(self.min_tokens, best + 1):
                    continue
                differ = np.flatnonzero(held[:n] != want[:n])
                common = int(differ[0]) if differ.size else n
                if common > best:
                    best, best_key = common, key
            if best_key is None or best < self.min_tokens:
                return 0
            del self._entries[best_key]
            return best

    def put(self, tokens: Sequence[int]) -> None:
        """Remember that the stages hold `tokens` (a finished generation's history, as far as
        its KV reaches); a remembered history it starts with is covered by it and goes."""
        held = np.asarray(tokens, dtype=np.int64)
        if len(held) < self.min_tokens:
            return
        with self._lock:
            for key in [
                k
                for k, old in self._entries.items()
                if len(old) <= len(held) and np.array_equal(old, held[: len(old)])
            ]:
                del self._entries[key]
            self._entries[self._next] = held
            self._next += 1
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
