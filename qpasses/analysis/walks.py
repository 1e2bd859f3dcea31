"""How search-precision walks over promotion candidates.

A walk asks ``check(promoted)`` for scores one candidate at a time and decides from the answers
alone, so a parallel executor can replay it on speculated scores (qpasses.executors.speculate) and
reach the same result. ``fewest`` finds the fewest promotions that meet a target; ``aimed`` goes
on from there towards a higher aim while enough weighted ops stay 8-bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# evaluations the aim spends giving members back, and the failed ones in a row after which a search
# stops giving back: a best effort, each costs a run (yolo_detector's target search spent 20 giving
# back and kept all 74 promotions)
GIVE_BACK = 4
# a chunk whose return to 8 bits would save at most this share of the weighted ops' float-vs-int8
# latency and of the weights' size is not worth an evaluation
NEGLIGIBLE = 0.005


class Walk:
    """Scores asked so far (memoized) within an evaluation budget: ``spent`` evaluations before the
    walk, on the candidates ``base`` scores. A score is a lower bound (the check's score less its
    margin); ``upper(promoted)``, asked only of a candidate scored, the same margin up (default:
    the score: no margin)."""

    def __init__(self, check, budget: int, spent: int, base: dict, upper=None):
        self.check, self.budget, self.spent, self._upper = check, budget, spent, upper
        self.seen, self.known = dict(base), len(base)

    def score(self, promoted: list[str]) -> float:
        key = frozenset(promoted)
        if key not in self.seen:
            self.seen[key] = self.check(promoted)
        return self.seen[key]

    def upper(self, promoted: list[str]) -> float:
        score = self.score(promoted)
        return score if self._upper is None else self._upper(promoted)

    @property
    def left(self) -> int:
        return self.budget - self.spent - (len(self.seen) - self.known)


@dataclass(frozen=True)
class EightBitShare:
    """Which weighted ops each group's promotion takes out of 8 bits (``reads``: root -> op ids),
    what the 8-bit ones would cost in float (``eight``) of ``total``, and the share to keep;
    ``cost``: op id -> the latency it loses in float (analysis.op_costs; None: every op counts 1);
    ``weights``: root -> the weight values its promotion keeps float (a size cost, where the latency
    is lost anyway: a float weight whose op reads a float input)."""

    reads: dict
    eight: float
    total: float
    keep: float
    cost: dict | None = None
    weights: dict = field(default_factory=dict)

    def lost(self, names) -> float:
        return self._cost(set().union(*(self.reads.get(n, ()) for n in names)))

    def saved(self, chosen, back) -> float:
        """What giving ``back`` (of ``chosen``) to 8 bits saves: the ops no other member keeps out."""
        kept = set(back)
        return self.lost(chosen) - self.lost([n for n in chosen if n not in kept])

    def negligible(self, chosen, back) -> bool:
        """Whether giving ``back`` saves under ``NEGLIGIBLE`` of the latency and of the weights."""
        total = sum(self.weights.values())
        return (self.saved(chosen, back) <= NEGLIGIBLE * self.total
                and sum(self.weights.get(n, 0) for n in back) <= NEGLIGIBLE * total)

    def order(self, chosen) -> list[str]:
        """``chosen``, the costliest to give back first: by the latency its return alone saves, then
        its weights, then the latency of the ops it reads; ties: the last first."""
        return sorted(chosen[::-1], key=lambda n: (-self.saved(chosen, [n]), -self.weights.get(n, 0), -self.lost([n])))

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


def fewest(walk: Walk, ranked: list[str], target: float, start: int = 0, reserve: int = 0,
           share: EightBitShare | None = None) -> tuple[list[str], float]:
    """The fewest promotions found that meet ``target``: the smallest head of ``ranked`` that does
    (bisection; the first ``start`` are known to fall short together), then its members given back
    to 8 bits in halves while the target still holds, while more than ``reserve`` evaluations of the
    budget are left: the costliest first by ``share`` (EightBitShare.order; without a share or a cost
    in it: the least sensitive first), a chunk whose return would save under ``NEGLIGIBLE`` of the
    latency and of the weights not tried, until ``GIVE_BACK`` evaluations in a row fail. When not even all of
    ``ranked`` meets it: the best candidate seen within ``ranked``."""
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
    share = share if share is not None and share.total > 0 else None   # no weighted op to tell costs by
    chunks = [share.order(chosen) if share is not None else chosen[::-1]]
    misses = 0
    while chunks and walk.left > reserve and misses < GIVE_BACK:
        chunk = chunks.pop(0)
        if share is not None and share.negligible(chosen, chunk):
            continue
        dropped = set(chunk)
        trial = [n for n in chosen if n not in dropped]
        known = frozenset(trial) in walk.seen
        if walk.score(trial) >= target:
            chosen, misses = trial, 0
        else:
            misses += not known
            if len(chunk) > 1:
                chunks += [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
    return chosen, walk.score(chosen)


def aimed(walk: Walk, orders: list[list[str]], chosen: list[str], aim: float,
          share: EightBitShare) -> tuple[list[str], float, int]:
    """From ``chosen`` (short of ``aim``) towards ``aim``: each order of the candidates (``chosen``
    first) is cut to its longest head that keeps ``share.keep`` of the weighted ops' work 8-bit and that
    head is scored. A head whose margin up stays below the chosen's score (down) is measurably worse
    and dropped; of the rest, those the checks cannot tell from the best (their margins overlap) are
    equals, and the one that keeps the most latency float wins: more float removes quantization error
    in expectation, within the share the aim may spend (ppocr_v4_rec: one flipped character on one of
    8 check feeds read the graph-order head 1.7 dB below all-8-bit, 3.3 dB above it on 128 held-out
    samples). The winner is searched with ``fewest`` (at most ``GIVE_BACK`` evaluations giving members
    back, the costliest first) when it meets the aim, else kept whole. (promoted, score, index of the
    order; -1: ``chosen`` stays, as no head was scored or each read measurably lower.)"""
    floor = walk.score(chosen)
    heads, taken = [], set(chosen)
    for order in orders:
        ranked = list(chosen) + [n for n in order if n not in taken]
        heads.append(ranked[:share.cap(ranked)])
    scored = []
    for index, head in enumerate(heads):
        if len(head) > len(chosen) and walk.left >= 1:
            walk.score(head)
            scored.append(index)
    kept = [i for i in scored if walk.upper(heads[i]) >= floor]
    if not kept:
        return list(chosen), floor, -1
    top = max(walk.score(heads[i]) for i in kept)
    equals = [i for i in kept if walk.upper(heads[i]) >= top]
    best = max(equals, key=lambda i: (share.lost(heads[i]), walk.score(heads[i]), -i))
    head, best_score = heads[best], walk.score(heads[best])
    if best_score < aim:
        return head, best_score, best
    bisection = math.ceil(math.log2(len(head) - len(chosen) + 1))
    if walk.left < bisection:
        return head, best_score, best
    found, reached = fewest(walk, head, aim, start=len(chosen), reserve=max(0, walk.left - bisection - GIVE_BACK),
                            share=share)
    return found, reached, best
