"""KeptSamples: the first calibration feeds and the float model's outputs on them, kept by the
calibration run so select-by-snr, search-precision and the CLI's SNR line need not run the float
model again."""
from __future__ import annotations

import numpy as np


class KeptSamples:
    """The first ``limit`` validated feeds and the float model's outputs (``names``) on them, at
    most ``max_bytes`` in all: what select-by-snr scores variants against, without a second run.
    ``full``: a feed was left out for lack of room; ``source``: the data the feeds came from."""
    CACHE_KEY = "kept_samples"   # calibrate keeps them in ``ctx.cache`` under this key

    def __init__(self, limit: int, max_bytes: int = 64 * 2**20, source=None):
        self.limit, self.max_bytes, self.bytes, self.full = limit, max_bytes, 0, False
        self.source = source
        self.names: list[str] = []
        self.feeds: list[dict] = []
        self.outputs: list[list[np.ndarray]] = []

    def add(self, feed: dict, outputs: list) -> None:
        size = sum(v.nbytes for v in feed.values()) + sum(getattr(v, "nbytes", 0) for v in outputs)
        if len(self.feeds) >= self.limit or self.full:
            return
        if self.bytes + size > self.max_bytes:
            self.full = True
            return
        self.feeds.append(feed)
        self.outputs.append(outputs)
        self.bytes += size
