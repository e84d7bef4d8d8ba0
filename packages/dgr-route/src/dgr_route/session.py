"""A generation that outlives its route (story DGR-047).

A route change is a cache miss, never KV migration: the session keeps only its tokens (prompt and
everything generated so far). When it moves to another route, because the caller switched it or
because a stage died and `replace` offered a new route, it bumps its epoch and re-prefills those
tokens on the new route from n_past 0, then goes on decoding. Stages that held the session under
the old epoch drop that cache when they see the new one (and the old route's streams close their
sessions when they end).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dgr.v1 import shard_pb2 as pb

from dgr_route.route import Route, RouteError, Sampling

# given the error that ended the current route, a route to resume on, or None to give up
Replacement = Callable[[RouteError], Route | None]


@dataclass
class RouteSession:
    route: Route
    sampling: Sampling = field(default_factory=Sampling)
    session_id: int = field(default_factory=lambda: secrets.randbits(63))
    epoch: int = 1
    max_resumes: int = 3
    failures: list[RouteError] = field(default_factory=list)
    _next: Route | None = None

    def switch(self, route: Route) -> None:
        """Move to `route` before the next token (re-prefill under a new epoch)."""
        self._next = route

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: set[int] | None = None,
        replace: Replacement | None = None,
    ) -> Iterator[int]:
        for result in self.results(prompt, max_tokens, stop, replace):
            yield int(result.token_id)

    def results(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: set[int] | None = None,
        replace: Replacement | None = None,
    ) -> Iterator[pb.TokenResult]:
        history = list(prompt)
        produced = 0
        while produced < max_tokens:
            run = self.route.run(
                self.session_id,
                self.epoch,
                history,
                max_tokens - produced,
                self.sampling,
                stop,
                prompt_len=len(prompt),  # generated tokens replay in lane-exact batches
            )
            try:
                for result in run:
                    yield result
                    produced += 1
                    history.append(int(result.token_id))
                    if stop and result.token_id in stop:
                        return
                    if self._next is not None:
                        break
                else:
                    return
            except RouteError as err:
                self.failures.append(err)
                resume = (
                    replace(err) if replace and len(self.failures) <= self.max_resumes else None
                )
                if resume is None:
                    raise
                self._next = resume
            finally:
                run.close()
            if self._next is not None:
                self.route, self._next = self._next, None
                self.epoch += 1
