"""Speculative evaluation for a sequential search whose next candidate depends on the last score.

The search is written as a walk: a deterministic function of an oracle that scores candidates.
With a parallel executor the caller replays the walk on the scores known so far; where it asks for
an unknown candidate (``Unknown``), ``frontier`` lists the candidates the walk may ask for next,
breadth first over the outcomes not known yet (a candidate meets the target or not), as many as
the executor has workers; the caller scores them at once and replays again. The replay consumes
scores in the one-process order, so it decides what the one-process run decides; a candidate it
never asks for costs a task and nothing else. For a bisection with 2^k - 1 workers a round covers
k levels (the interval shrinks 2^k times per round, as k-ary cut points would, but at the cut
points the one-process run would check). The driver builds a round's candidates one after the
other, so ``width`` caps a round where building them would cost more than the levels it saves.
"""
from __future__ import annotations

import math

LAST: dict = {}   # the last speculative search: rounds, candidates scored and used, seconds (tools/bench_ray.py)


class Unknown(Exception):
    """A walk asked for a candidate nobody has scored: ``key`` (hashable) and ``item`` (what to build)."""

    def __init__(self, key, item):
        super().__init__(repr(key))
        self.key, self.item = key, item


class Stop(Exception):
    """A walk cannot go on past a known candidate (it failed to build: the real walk raises there)."""


def frontier(walk, width: int, outcomes: tuple, max_walks: int = 256) -> list:
    """Up to ``width`` (key, item) candidates the walk may ask for next, in breadth-first order.

    ``walk(assumed)`` runs the decisions answering from the known scores and then from
    ``assumed`` ({key: score}); it raises ``Unknown`` at the first candidate neither holds, ``Stop``
    where it cannot go on, and returns when it finishes. Each unknown candidate branches once per
    value in ``outcomes`` (e.g. a score meeting the target and one failing it)."""
    queue, found = [{}], {}
    for _ in range(max_walks):
        if not queue or len(found) >= width:
            break
        assumed = queue.pop(0)
        try:
            walk(assumed)
        except Unknown as miss:
            found.setdefault(miss.key, miss.item)
            queue += [assumed | {miss.key: value} for value in outcomes]
        except Stop:
            pass
    return list(found.items())


def width(workers: int, build: float, score: float) -> int:
    """Candidates per round: the n <= ``workers`` that minimises (n * build + score) / log2(n + 1),
    the seconds per bisection level when the driver builds n candidates one after the other (each
    ``build`` seconds, its task starting then) and a task scores one in ``score`` seconds; all
    ``workers`` until both are measured."""
    if build <= 0 or score <= 0:
        return max(1, workers)
    return min(range(1, max(1, workers) + 1), key=lambda n: ((n * build + score) / math.log2(n + 1), n))
