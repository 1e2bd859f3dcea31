"""Variants scored as parallel tasks: each task runs one quantized model on every reference feed
and returns its squared error per feed and output (or component); the driver replays the duels on those errors
(``Replayed``), so it decides what the one-process run decides, sample counts and early stops
included. The reference (feeds and float outputs) goes to the object store once.
``objective_scores``: search-precision's candidates, each task one overall objective score."""
from __future__ import annotations

import time

from ..errors import first_line
from ..evaluation.duels import Contender
from ..evaluation.evaluate import Reference
from . import portable


def errors_task(model, shared) -> dict:
    """Runs on a worker: ``model`` (ONNX bytes, or the exception that stopped building it) run on
    every feed of the shared reference; ``done`` feeds ran before ``failure`` (-1: no session)."""
    reference = shared
    if isinstance(model, BaseException):
        return {"errors": None, "done": -1, "failure": model}
    try:
        contender = Contender(reference, model)
    except Exception as exc:
        return {"errors": None, "done": -1, "failure": portable(exc)}
    failure = None
    for i in range(len(reference.feeds)):
        try:
            contender.advance(i + 1)
        except Exception as exc:
            failure = portable(exc)
            break
    return {"errors": contender.errors, "done": contender.ran, "failure": failure}


class Replayed(Contender):
    """A Contender whose runs happened in a task: ``advance`` reveals the errors feed by feed and
    raises the task's failure on the feed that failed, as the Contender would have."""

    def __init__(self, reference: Reference, result: dict, *, penalty: float = 0.0):
        if result["done"] < 0:
            raise result["failure"]
        self.reference, self.penalty, self.dropped, self.session = reference, penalty, False, None
        self.errors, self.ran = result["errors"], 0
        self._done, self._failure = result["done"], result["failure"]

    def advance(self, upto: int) -> None:
        upto = min(upto, len(self.reference.feeds))
        if self._failure is not None and upto > self._done:
            self.ran = max(self.ran, self._done)
            raise self._failure
        self.ran = max(self.ran, upto)


def prescored(executor, reference: Reference, models: list, penalties: list[float]):
    """Score ``models`` (ONNX bytes, or the exception that stopped building one) as tasks of
    ``executor``; returns ``contender(i)``: model i's Replayed contender (raises what its
    build or session raised)."""
    shared = executor.put(reference)
    results = list(executor.map(errors_task, models, shared))
    return lambda i: Replayed(reference, results[i], penalty=penalties[i])


def objective_score(reference: Reference, model, objective, reuse=None) -> dict:
    """The objective's overall score of ``model`` on the reference feeds and its standard error
    (jackknife over the feeds); a model onnxruntime cannot run scores -inf, ``failed`` says why
    (search-precision's check, in process or as a task). ``reuse``: outputs of a model already
    run (Reference.runs_of)."""
    try:
        scored = reference.score(model, judged=True, objective=objective, per_output=False, reuse=reuse)
        return {"score": float(scored["objective"]["overall"]), "standard_error": scored["standard_error"],
                "failed": None}
    except Exception as exc:
        return {"score": float("-inf"), "standard_error": 0.0, "failed": first_line(exc)}


def trial_bytes(model, then, ctx, edit=None, fresh=None) -> bytes:
    """A copy of ``model`` (``edit`` applied to it) made a QDQ model by the nested pipeline ``then``.
    ``fresh``: ``model.copier()``, made once for many trials."""
    trial = fresh() if fresh is not None else model.copy(share_weights=True)
    if edit is not None:
        edit(trial)
    then.run(trial, ctx)
    return trial.to_proto(metadata=False).SerializeToString()


def trial_score(model, then, ctx, reference: Reference, objective, edit=None, reuse=None) -> float:
    """The objective's score of ``trial_bytes``: a pass's check of one change against the model as it is
    (``reuse``: objective_score's)."""
    return objective_score(reference, trial_bytes(model, then, ctx, edit), objective, reuse)["score"]


def objective_task(model: bytes, shared) -> dict:
    """Runs on a worker: ``objective_score`` of one candidate (``shared``: reference, objective)."""
    began = time.perf_counter()
    reference, objective = shared
    return objective_score(reference, model, objective) | {"seconds": time.perf_counter() - began}


def objective_scores(executor, shared, models) -> list[dict]:
    """``objective_score`` of every model (ONNX bytes; an iterable: a task starts as soon as its model
    is built), as tasks of ``executor``, in order; ``shared``: ``executor.put((reference, objective))``,
    once for all the rounds of a search."""
    return list(executor.map(objective_task, models, shared))
