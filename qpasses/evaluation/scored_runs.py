"""Outputs of a model already judged on some feeds, reused by a later check of the same model
(same bytes and feeds): onnxruntime computes the same values again."""
from __future__ import annotations

import hashlib

import numpy as np

from ..ir.model import QModel


class ScoredRuns:
    """A test model's outputs in evaluate.judging_session on its first ``keep`` feeds (at most
    ``max_bytes``), kept so a later check of the very same model on the same feeds takes them instead
    of running it again
    (select-by-snr's chosen variant is search-precision's first check, through ``ctx.cache``).
    The model (``data``: its bytes) is known by its size and digest."""

    CACHE_KEY = "scored_runs"

    def __init__(self, data: bytes, keep: int, max_bytes: int = 64 * 2**20):
        self.digest, self.size = _digest(data), len(data)
        self.keep, self.max_bytes, self.bytes = keep, max_bytes, 0
        self.feeds: list[dict] = []
        self.outputs: list[dict] = []
        self.io: tuple[list[str], list[str]] = ([], [])   # its session's input and output names

    def add(self, reference, index: int, values: list) -> None:
        if index != len(self.feeds) or index >= self.keep:
            return
        size = sum(np.asarray(v).nbytes for v in values)
        if self.bytes + size > self.max_bytes:
            self.keep = index
            return
        self.bytes += size
        self.feeds.append(reference.feeds[index])
        self.outputs.append(dict(zip(reference.names, values)))

    def runs_for(self, data: bytes, reference) -> list | None:
        """The outputs ``reference.names`` on the first of ``reference.feeds`` (as many as it holds) if
        this is the same model (bytes) and those are its feeds (values, types and shapes), else None."""
        feeds = reference.feeds[:len(self.feeds)]
        if not feeds or len(data) != self.size or _digest(data) != self.digest:
            return None
        for mine, theirs in zip(self.feeds, feeds):
            if mine.keys() != theirs.keys() or not all(_same_array(mine[k], theirs[k]) for k in mine):
                return None
        if not all(n in self.outputs[0] for n in reference.names):
            return None
        return [[self.outputs[i][n] for n in reference.names] for i in range(len(feeds))]


def model_bytes(model) -> bytes:
    """A QModel, ModelProto or bytes as the bytes onnxruntime loads (``evaluate.session``)."""
    if isinstance(model, QModel):
        model = model.to_proto()
    return model if isinstance(model, bytes) else model.SerializeToString()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _same_array(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
