"""search-precision with a parallel executor: candidates scored several at once, found by replaying
the search's decisions on the scores known (qpasses.executors.speculate); the checks, the decision
and the model are the one-process run's. Ray: tests/executors/test_ray.py."""
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from qpasses import executors
from qpasses.analysis.walks import EightBitShare
from qpasses.core.context import Findings, RunContext
from qpasses.core.pipeline import PassManager
from qpasses.evaluation.objective import Objective
from qpasses.executors import speculate
from qpasses.ir.model import from_proto, save
from qpasses.passes.search_precision import SearchPrecision
from qpasses.passes.search_precision.checks import Checks
from qpasses.testing import parse

BRANCHES = 6
# Six squares into Tanh, two of them fed outliers that stretch their 8-bit grids: twelve tensor
# groups to rank, four of them worth keeping float.
BRANCHY = ("g (" + ", ".join(f"float[1, 64] x{i}" for i in range(BRANCHES)) + ") => ("
           + ", ".join(f"float[1, 64] y{i}" for i in range(BRANCHES)) + ")\n{\n"
           + "\n".join(f"  h{i} = Mul(x{i}, x{i})\n  y{i} = Tanh(h{i})" for i in range(BRANCHES)) + "\n}\n")


def _feeds(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feed = {f"x{i}": rng.normal(0.0, 1.0, (1, 64)).astype(np.float32) for i in range(BRANCHES)}
        for i in (1, 4):
            feed[f"x{i}"][0, rng.integers(0, 64)] = rng.choice([-30.0, 30.0]) * (i + 1)
        out.append(feed)
    return out


def _run(workers, monkeypatch, tmp_path, **options):
    monkeypatch.setitem(executors._cache, ("local", None), executors.LocalExecutor(workers))
    monkeypatch.setattr(speculate, "width", lambda workers, build, score: workers)   # not from timings
    speculate.LAST.clear()
    model = from_proto(parse(BRANCHY))
    ctx = RunContext({"op_types_to_quantize": ["Tanh", "Mul"], "calibration": {"method": "minmax"}}, _feeds(40))
    PassManager("annotate-types,calibrate{hold_out=8}").run(model, ctx)
    PassManager([SearchPrecision(**options)]).run(model, ctx)
    PassManager("compute-qparams,fix-bias-scales,insert-qdq,insert-converts").run(model, ctx)
    blob = save(model, tmp_path / f"w{workers}.onnx").read_bytes()
    return model.decisions["precision_search"], ctx.findings.as_dict()["search-precision"], blob, dict(speculate.LAST)


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_parallel_search_decides_and_writes_the_same(workers, monkeypatch, tmp_path):
    local, local_findings, local_bytes, none = _run(1, monkeypatch, tmp_path, target=30)
    assert none == {} and local["met"] and len(local["promoted"]) >= 2 and local["evaluations"] > 6
    decision, findings, blob, spec = _run(workers, monkeypatch, tmp_path, target=30)
    assert decision == local and findings == local_findings and blob == local_bytes
    assert spec["used"] == local["evaluations"] - 1   # every check of the search came from a task
    assert spec["rounds"] < spec["used"] and spec["scored"] <= spec["rounds"] * workers


class _Table(Checks):
    """The search over a made-up score table: the replay against the one-process walk."""

    def __init__(self, table: dict, broken: set, workers: int, target: float, names: list[str]):
        self.scores, self.known, self.evaluations, self.budget = {}, {}, 0, int(2 * math.log2(len(names))) + 16
        self.raw, self.uppers, self.options = {}, {}, SimpleNamespace(confidence=1.0)   # checks compare score - 0.5
        self.speculated, self.local_db, self.aimed = {}, None, ""
        self.objective = Objective("cosine")   # a linear metric: the bound is the score less 0.5
        self.table, self.broken, self.target, self.names, self.asked = table, broken, target, names, []
        self.executor, self.seconds = executors.LocalExecutor(workers), {"build": 0.0, "built": 0, "tasks": 0.0, "scored": 0}
        self.ctx = RunContext({}, None)
        self.ctx.findings = Findings()
        self.bar = type("Bar", (), {"update": lambda self, n: None})()

    def _evaluate(self, batch):
        for promoted in batch:
            key = frozenset(promoted)
            if key in self.broken:
                if not self.executor.parallel:
                    raise KeyError(sorted(key))
                self.known[key] = KeyError(sorted(key))
            else:
                self.known[key] = {"score": self.table[key], "standard_error": 0.5, "failed": None}

    def _take(self, key):
        super()._take(key)
        self.asked.append(key)

    def ranked(self):
        return list(self.names)

    def _orders(self):
        return [list(self.names), self.names[::-1]]

    def _share(self, keep):   # name i is read by ops i and i + 1 of len(names) + 1
        return EightBitShare({n: {i, i + 1} for i, n in enumerate(self.names)}, len(self.names) + 1,
                             len(self.names) + 1, keep)


def _outcome(search, aim=None):
    try:
        search.check([])
        chosen, reached = search.search()
        if aim is not None and reached < aim:
            chosen, reached = search.aim(chosen, aim, 0.3)
        return (chosen, reached, search.aimed), search.asked, search.evaluations
    except KeyError as exc:
        return "raised", exc.args, search.asked


@pytest.mark.parametrize("seed", range(60))
def test_replay_checks_what_the_one_process_walk_checks(seed):
    """Random, non-monotone score tables (some candidates fail to build): every executor width
    checks the same candidates in the same order, chooses the same and raises where the
    one-process run raises; a candidate only speculated never raises. Half the walks then go on
    towards a higher aim within an 8-bit share, over two orders."""
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(rng.randint(2, 14))]
    table = _Scores(seed, len(names))
    broken = {frozenset(names[:rng.randint(1, len(names) - 1)])} if seed % 3 == 0 else set()
    target = rng.uniform(5, 35)
    aim = target + rng.uniform(1, 6) if seed % 2 else None
    local = _outcome(_Table(table, broken, 1, target, names), aim)
    for workers in (2, 3, 5, 8):
        assert _outcome(_Table(table, broken, workers, target, names), aim) == local


class _Scores(dict):
    """A score per set of promoted names: mostly better with more of them, noisy, the same whoever asks first."""

    def __init__(self, seed: int, total: int):
        super().__init__()
        self.seed, self.total = seed, total

    def __missing__(self, key):
        return len(key) / self.total * 40 + random.Random(f"{self.seed}:{sorted(key)}").uniform(-8, 8)


def test_frontier_is_breadth_first_over_outcomes():
    """A bisection over 8 candidates with 3 workers: the midpoint, then both next midpoints."""
    def walk(assumed):
        lo, hi = 0, 8
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mid not in assumed:
                raise speculate.Unknown(mid, mid)
            lo, hi = (lo, mid) if assumed[mid] else (mid, hi)

    assert [k for k, _ in speculate.frontier(walk, 3, (True, False))] == [4, 2, 6]
    assert [k for k, _ in speculate.frontier(walk, 7, (True, False))] == [4, 2, 6, 1, 3, 5, 7]


def test_width_caps_a_round_where_building_costs_more_than_it_saves():
    assert speculate.width(8, 0.0, 0.0) == 8   # not measured yet: every worker
    assert speculate.width(8, 1.0, 0.5) == 1   # building dominates: one candidate a round
    assert speculate.width(8, 1.0, 3.0) == 3   # two levels a round
    assert speculate.width(8, 0.1, 20.0) == 8 and speculate.width(64, 1.0, 20.0) == 11   # a big cluster: capped
    assert speculate.width(2, 1.0, 1.0) == 2 and speculate.width(2, 1.0, 0.6) == 1
