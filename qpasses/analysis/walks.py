"""How search-precision walks over promotion candidates.

A walk asks ``check(promoted)`` for scores one candidate at a time and decides from the answers
alone, so a parallel executor can replay it on speculated scores (qpasses.executors.speculate) and
reach the same result. ``fewest`` finds the fewest promotions that meet a target; ``aimed`` goes
on from there towards a higher aim while enough weighted ops stay 8-bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIVE_BACK = 4   # evaluations the aim spends giving members back: it is a best effort, and each costs a run


class Walk:
    """Scores asked so far (memoized) within an evaluation budget: ``spent`` evaluations before the
    walk, on the candidates ``base`` scores."""

    def __init__(self, check, budget: int, spent: int, base: dict):
        self.check, self.budget, self.spent = check, budget, spent
        self.seen, self.known = dict(base), len(base)

    def score(self, promoted: list[str]) -> float:
        key = frozenset(promoted)
        if key not in self.seen:
            self.seen[key] = self.check(promoted)
        return self.seen[key]

    @property
    def left(self) -> int:
        return self.budget - self.spent - (len(self.seen) - self.known)


@dataclass(frozen=True)
class EightBitShare:
    """Which weighted ops each group's promotion takes out of 8 bits (``reads``: root -> op ids),
    what the 8-bit ones cost now (``eight``) of ``total``, and the share to keep; ``cost``: op id ->
    its multiply-accumulates (None: every op counts 1)."""

    reads: dict
    eight: float
    total: float
    keep: float
    cost: dict | None = None

    def lost(self, names) -> float:
        return self._cost(set().union(*(self.reads.get(n, ()) for n in names)))

    def _cost(self, ops: set) -> float:
        return float(len(ops)) if self.cost is None else sum(self.cost[i] for i in ops)

    def cap(self, ranked: list[str]) -> int:
        """The longest head of ``ranked`` whose promotion keeps ``keep`` of the weighted ops' cost 8-bit."""
        lost: set = set()
        for i, name in enumerate(ranked):
            lost |= self.reads.get(name, set())
            if self.eight - self._cost(lost) < self.keep * self.total:
                return i
        return len(ranked)


def fewest(walk: Walk, ranked: list[str], target: float, start: int = 0, reserve: int = 0) -> tuple[list[str], float]:
    """The fewest promotions found that meet ``target``: the smallest head of ``ranked`` that does
    (bisection; the first ``start`` are known to fall short together), then its members given back
    to 8 bits in halves while the target still holds (the least sensitive first), while more than
    ``reserve`` evaluations of the budget are left. When not even all of ``ranked`` meets it: the
    best candidate seen within ``ranked``."""
    if walk.score(ranked) < target:
        inside = set(ranked)
        best = max((k for k in walk.seen if k <= inside), key=lambda k: (walk.seen[k], -len(k)))
        return [n for n in ranked if n in best], walk.seen[best]
    lo, hi = start, len(ranked)   # score(ranked[:lo]) < target <= score(ranked[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if walk.score(ranked[:mid]) >= target:
            hi = mid
        else:
            lo = mid
    chosen = ranked[:hi]
    chunks = [chosen[::-1]]   # least sensitive first
    while chunks and walk.left > reserve:
        chunk = chunks.pop(0)
        dropped = set(chunk)
        trial = [n for n in chosen if n not in dropped]
        if walk.score(trial) >= target:
            chosen = trial
        elif len(chunk) > 1:
            chunks += [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
    return chosen, walk.score(chosen)


def aimed(walk: Walk, orders: list[list[str]], chosen: list[str], aim: float,
          share: EightBitShare) -> tuple[list[str], float, int]:
    """From ``chosen`` (short of ``aim``) towards ``aim``: each order of the candidates (``chosen``
    first) is cut to its longest head that keeps ``share.keep`` of the weighted ops' work 8-bit and that
    head is scored; the order whose head scores highest is then searched with ``fewest`` (at most
    ``GIVE_BACK`` evaluations giving members back). (promoted, score, index of the order; -1:
    ``chosen`` stays, as nothing within the share scored higher.)"""
    best, best_score = -1, walk.score(chosen)
    heads, taken = [], set(chosen)
    for order in orders:
        ranked = list(chosen) + [n for n in order if n not in taken]
        heads.append(ranked[:share.cap(ranked)])
    for index, head in enumerate(heads):
        if len(head) > len(chosen) and walk.left >= 1 and walk.score(head) > best_score:
            best, best_score = index, walk.score(head)
    if best < 0:
        return list(chosen), walk.score(chosen), -1
    head = heads[best]
    bisection = math.ceil(math.log2(len(head) - len(chosen) + 1))
    if best_score >= aim and walk.left < bisection:
        return head, best_score, best
    found, reached = fewest(walk, head, aim, start=len(chosen), reserve=max(0, walk.left - bisection - GIVE_BACK))
    return found, reached, best
