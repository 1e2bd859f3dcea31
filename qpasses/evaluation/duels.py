"""Variants scored against a Reference feed by feed, and duels between them that stop as soon as
one clearly trails (select-by-snr; qpasses.executors.scoring replays them on a task's errors)."""
from __future__ import annotations

import math

import numpy as np

from ..executors.threads import thread_count
from .evaluate import Reference, check_same_signature, io_names, judging_session, run_feeds, snr_from_sums
from .scored_runs import ScoredRuns, model_bytes


def duel(reference: Reference, best: "Contender", challenger: "Contender", *, min_samples: int = 8,
         z: float = 3.0) -> "Contender":
    """Run ``best`` and ``challenger`` on the same feeds, ``best`` a block of ``min_samples``
    ahead, until one trails the other by more than ``z`` standard errors (paired jackknife over
    the feeds both ran) both with and without the penalties (checked from ``min_samples`` feeds
    on; ``z`` = 0: never) or every feed ran. Returns the winner (a tie: ``best``); a loser that stopped early
    is marked ``dropped``. onnxruntime's errors are raised."""
    n = len(reference.feeds)
    best.advance(min_samples)
    while challenger.ran < n:
        if challenger.ran >= best.ran:
            best.advance(best.ran + max(min_samples, 1))
        challenger.advance(challenger.ran + 1)
        if z > 0 and min_samples <= challenger.ran < n:
            for loser, winner in ((challenger, best), (best, challenger)):
                # behind with and without the penalties: feeds on which both score alike
                # (saturated outputs) have no spread, and a penalty alone must not stop a variant
                if loser.margin(winner, z, penalties=False) < min(0.0, loser.penalty - winner.penalty):
                    loser.dropped = True
                    return winner
    return challenger if challenger.score() > best.score() else best


class Contender:
    """A test model scored against a Reference feed by feed (in evaluate.judging_session), resumable:
    ``advance(m)`` runs it on the kept feeds up to the m-th; its score is its worst output SNR (of a component, after
    Reference.split) over the feeds it ran minus ``penalty``; ``errors``: per feed and column
    (Reference.sums), the sum of squared errors. ``keep``: its outputs
    on the first ``keep`` feeds are kept (``kept``, a ScoredRuns) for a later check of the same model."""

    def __init__(self, reference: Reference, test_model, *, penalty: float = 0.0, keep: int = 0):
        self.reference, self.penalty, self.dropped = reference, penalty, False
        self.kept = None
        if keep > 0:   # its first outputs are kept (ScoredRuns): the model is identified by its bytes
            test_model = model_bytes(test_model)
            self.kept = ScoredRuns(test_model, keep)
        self.session = judging_session(test_model)
        if self.kept is not None:
            self.kept.io = io_names(self.session)
        check_same_signature(reference.inputs, reference.names, self.session)
        self.errors = np.zeros(reference.signal().shape)
        self.ran = 0
        self.ahead: dict[int, list] = {}   # feed -> outputs run with others side by side, not counted yet

    def advance(self, upto: int) -> None:
        ref = self.reference
        stop = min(upto, len(ref.feeds))
        if stop <= self.ran:
            return
        todo = [i for i in range(self.ran, min(len(ref.feeds), max(stop, self.ran + thread_count())))
                if i not in self.ahead]
        self.ahead.update(zip(todo, run_feeds(self.session, ref.names, [ref.feeds[i] for i in todo])))
        for i in range(self.ran, stop):
            values = self.ahead.pop(i)
            if self.kept is not None:
                self.kept.add(ref, i, values)
            self.errors[i] = ref.sums(i, values)
            self.ran = i + 1

    def snr(self) -> float:
        """The worst output (or component) SNR over the feeds it ran."""
        return float(_worst_snr(self.reference.signal()[:self.ran].sum(0), self.errors[:self.ran].sum(0)))

    def score(self) -> float:
        return self.snr() - self.penalty

    def margin(self, other: "Contender", z: float = 0.0, penalties: bool = True) -> float:
        """This score (SNR without ``penalties``) minus ``other``'s over the feeds both ran, plus
        ``z`` standard errors."""
        m = min(self.ran, other.ran)
        handicap = other.penalty - self.penalty if penalties else 0.0
        return _margin(self.reference.signal()[:m], self.errors[:m], other.errors[:m], z) + handicap

    def close(self) -> None:
        """Free the onnxruntime session (the errors stay)."""
        self.session = None


def _worst_snr(signal: np.ndarray, error: np.ndarray):
    """min over outputs (last axis) of the SNR from the sums (``snr_from_sums``)."""
    return snr_from_sums(signal, error).min(axis=-1)


def _margin(signal: np.ndarray, errors: np.ndarray, best: np.ndarray, z: float) -> float:
    """The SNR from per-feed ``errors`` minus the one from ``best`` (same feeds: rows), plus ``z``
    paired jackknife standard errors of that difference (SNRs capped to +-400 dB)."""
    n, total = signal.shape[0], signal.sum(0)

    def snrs(e):   # over all rows, and leaving each row out
        loo = _worst_snr(np.maximum(total - signal, 0), np.maximum(e.sum(0) - e, 0))
        return np.clip(_worst_snr(total, e.sum(0)), -400, 400), np.clip(loo, -400, 400)

    (full, loo), (best_full, best_loo) = snrs(errors), snrs(best)
    diff = loo - best_loo
    return float(full - best_full) + z * math.sqrt((n - 1) / n * float(np.sum((diff - diff.mean()) ** 2)))
