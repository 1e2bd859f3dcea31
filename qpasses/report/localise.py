"""When reading the integer tensors changes what the provider executes (the output SNR as deployed
and with every tensor read differ by more than ``THRESHOLD_DB``), the per-layer table cannot point
at the cause: bisect over the read tensors to name the ones whose reading changes the output.

The tensors are taken in graph order, ``S``. ``f(T)`` is the worst output SNR against the float
model with the tensors ``T`` read (one provider compilation each); ``T`` *changes* the output when
``f(T)`` moved from the deployed SNR ``f()`` towards ``f(S)`` by more than ``THRESHOLD_DB``. The
search keeps ``lo < hi`` such that ``S[start:lo]`` does not change it and ``S[start:hi]`` does, and
halves ``hi - lo`` until one tensor, ``S[hi - 1]``, makes the difference: ceil(log2 n)
compilations, plus one to measure it read alone. It then resumes after that tensor (if reading
the rest still changes the output), to name up to ``MAX_FOUND`` tensors. Sound whatever the
provider does: a named tensor is one whose reading, after those before it in ``S[start:]``,
changes the output.
"""
from __future__ import annotations

import math

import numpy as np

from ..evaluation.evaluate import snr_from_sums

THRESHOLD_DB = 1.0
MAX_FOUND = 3


def worst_snr(runs: list[list[np.ndarray]], refs: list[list[np.ndarray]]) -> float:
    """The worst output SNR (dB) of ``runs`` (per feed, the output values) against ``refs``."""
    if not runs:
        return math.nan
    snrs = []
    for k in range(len(refs[0])):
        x = np.concatenate([np.asarray(r[k], np.float64).ravel() for r in refs])
        e = np.concatenate([np.asarray(r[k], np.float64).ravel() for r in runs]) - x
        signal, error = float(x @ x), float(e @ e)
        snrs.append(snr_from_sums(signal, error))
    return min(snrs)


def _clip(v: float) -> float:
    return min(max(v, -400.0), 400.0)


def _gap(a: float, b: float) -> bool:
    return abs(_clip(a) - _clip(b)) > THRESHOLD_DB


def _like_read(value: float, deployed: float, read: float) -> bool:
    """Whether ``value`` moved from the deployed SNR towards the one with every tensor read by more
    than THRESHOLD_DB."""
    toward = 1.0 if _clip(read) >= _clip(deployed) else -1.0
    return toward * (_clip(value) - _clip(deployed)) > THRESHOLD_DB


def localise(backend, names: list[str], feeds: list[dict], refs: list[list[np.ndarray]],
             deployed: float, read: float) -> dict | None:
    """The tensors of ``names`` (graph order) whose reading changes the provider's output SNR from
    ``deployed``, given ``read`` (all of ``names`` read); None when the two are within THRESHOLD_DB.
    ``backend.reading(subset)`` compiles the model with ``subset`` read and returns a function of a
    feed giving its outputs."""
    if not names or not _gap(deployed, read):
        return None
    compiled = 0

    def snr(subset: list[str]) -> float:
        nonlocal compiled
        compiled += 1
        run = backend.reading(subset)
        return worst_snr([run(feed) for feed in feeds], refs)

    found, start, whole = [], 0, read
    while start < len(names) and len(found) < MAX_FOUND:
        if start and not _like_read(whole := snr(names[start:]), deployed, read):
            break
        lo, hi, at_hi = start, len(names), whole
        while hi - lo > 1:
            mid = (lo + hi) // 2
            value = snr(names[start:mid])
            if _like_read(value, deployed, read):
                hi, at_hi = mid, value
            else:
                lo = mid
        tensor = names[hi - 1]
        alone = at_hi if hi - 1 == start else snr([tensor])
        found.append({"tensor": tensor, "snr_read_alone_db": alone, "snr_read_after_earlier_db": at_hi,
                      "earlier_read": hi - 1 - start})
        start = hi
    return {"deployed_snr_db": deployed, "read_snr_db": read, "threshold_db": THRESHOLD_DB,
            "searched": len(names), "compilations": compiled, "found": found,
            "complete": start >= len(names) or len(found) < MAX_FOUND}


def lines(result: dict | None) -> list[str]:
    """The localisation as text lines (none when reading the tensors changed nothing)."""
    if not result:
        return []
    a = result["deployed_snr_db"]
    out = [f"reading the tensors changes the output SNR from {a:.1f} dB (as deployed) to {result['read_snr_db']:.1f} dB; "
           f"bisected over {result['searched']} read tensors in {result['compilations']} compilations:"]
    for f in result["found"]:
        alone, after, earlier = f["snr_read_alone_db"], f["snr_read_after_earlier_db"], f["earlier_read"]
        if _like_read(alone, a, result["read_snr_db"]):
            why = f"reading it changes the output from {a:.1f} dB to {alone:.1f} dB" + (
                f"; with the {earlier} read tensors before it, to {after:.1f} dB" if _gap(after, alone) else "")
        else:
            why = (f"reading it after the {earlier} tensors before it changes the output from {a:.1f} dB to "
                   f"{after:.1f} dB; alone it does not ({alone:.1f} dB)")
        out.append(f"  the provider's execution differs around {f['tensor']} ({why})")
    if not result["found"]:
        out.append("  no single tensor found")
    elif not result["complete"]:
        out.append(f"  (stopped after {len(result['found'])}; later tensors may matter too)")
    return out
