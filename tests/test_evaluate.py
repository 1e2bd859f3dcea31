"""evaluate.Reference.race: scoring several models feed by feed and stopping the clear losers early."""
import numpy as np
import pytest

from qpasses.evaluate import Reference, compare
from qpasses.testing import parse

IDENTITY = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1, 256] x) => (float[1, 256] y) {
    y = Identity(x)
}
"""

# y = x + a * sin(k * x): an error of about a / sqrt(2) per value, which varies from feed to feed
NOISY = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1, 256] x) => (float[1, 256] y) <float k = {{{k}}}, float a = {{{a}}}> {{
    kx = Mul(x, k)
    s = Sin(kx)
    e = Mul(s, a)
    y = Add(x, e)
}}
"""


def noisy(a, k=37.0):
    return parse(NOISY.format(a=a, k=k))


def reference(n=32):
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 256)).astype(np.float32)} for _ in range(n)]
    return Reference.run(parse(IDENTITY), feeds)


def race(ref, models, penalties=None, **options):
    """Challenge each model against the best so far, as select-by-snr does."""
    best, results = None, []
    for model, penalty in zip(models, penalties or [0.0] * len(models)):
        result = ref.challenge(model, best, penalty=penalty, **options)
        results.append(result)
        if not result.get("dropped") and (best is None or result["score"] > best["score"]):
            best = result
    return results


def test_a_clear_loser_stops_after_the_minimum():
    ref = reference()
    results = race(ref, [noisy(0.01), noisy(0.3)], min_samples=8)
    assert results[0]["samples"] == 32 and "dropped" not in results[0] and "margin_db" not in results[0]
    assert results[1]["dropped"] and results[1]["samples"] == 8
    assert results[1]["margin_db"] == pytest.approx(results[1]["snr_db"] - 20 * np.log10(0.3 / 0.01), abs=1e-6) \
        or results[1]["margin_db"] < -25
    assert results[0]["snr_db"] > results[1]["snr_db"] + 25


def test_close_models_run_every_feed_and_match_a_full_comparison():
    ref = reference()
    models = [noisy(0.01, 37.0), noisy(0.01, 53.0)]   # same error size, different per feed
    results = race(ref, models, min_samples=8)
    assert [r["samples"] for r in results] == [32, 32] and not any("dropped" in r for r in results)
    for model, result in zip(models, results):
        assert result["snr_db"] == pytest.approx(ref.score(model)["snr_db"], abs=1e-6)
    full = compare(parse(IDENTITY), models[0], ref.feeds)
    assert results[0]["snr_db"] == pytest.approx(full["snr_db"], abs=1e-6)
    assert results[1]["margin_db"] == pytest.approx(results[1]["snr_db"] - results[0]["snr_db"], abs=1e-9)


def test_no_early_stop_with_z_0_and_a_better_challenger_runs_every_feed():
    ref = reference()
    assert [r["samples"] for r in race(ref, [noisy(0.01), noisy(0.3)], z=0)] == [32, 32]
    results = race(ref, [noisy(0.3), noisy(0.01)])
    assert [r["samples"] for r in results] == [32, 32] and results[1]["margin_db"] > 25


def test_penalties_count_on_both_sides():
    ref = reference()
    # 0.01 vs 0.012: 1.6 dB apart; a 10 dB penalty on the better one makes it the loser
    results = race(ref, [noisy(0.012), noisy(0.01)], penalties=[0.0, 10.0], min_samples=8)
    assert results[1].get("dropped") and results[1]["score"] == pytest.approx(results[1]["snr_db"] - 10)
    results = race(ref, [noisy(0.01), noisy(0.012)], penalties=[10.0, 0.0], min_samples=8)
    assert not results[1].get("dropped") and results[1]["margin_db"] > 8


def test_a_model_that_cannot_run_raises():
    broken = parse(IDENTITY.replace("y = Identity(x)", "z = Identity(x)").replace("(float[1, 256] y)", "(float[1, 256] z)"))
    with pytest.raises(Exception, match="reference output"):
        reference(12).challenge(broken)
