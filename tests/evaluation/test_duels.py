"""duels.duel: scoring models feed by feed against each other and stopping once one clearly leads."""
import numpy as np
import pytest

from qpasses.evaluation.duels import Contender, duel
from qpasses.evaluation.evaluate import Reference, compare
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
    """Duel each model against the best so far, as select-by-snr does: (contenders, winner)."""
    best, contenders = None, []
    for model, penalty in zip(models, penalties or [0.0] * len(models)):
        contender = Contender(ref, model, penalty=penalty)
        contenders.append(contender)
        best = contender if best is None else duel(ref, best, contender, **options)
    if len(contenders) == 1:
        best.advance(options.get("min_samples", 8))
    return contenders, best


def test_a_clear_loser_stops_after_the_minimum_and_so_does_the_winner():
    ref = reference()
    (good, bad), winner = race(ref, [noisy(0.01), noisy(0.3)], min_samples=8)
    assert winner is good and (good.ran, bad.ran) == (8, 8) and bad.dropped and not good.dropped
    assert bad.margin(good) < -25 and good.snr() > bad.snr() + 25
    (bad, good), winner = race(ref, [noisy(0.3), noisy(0.01)], min_samples=8)   # the challenger wins early
    assert winner is good and bad.dropped and (good.ran, bad.ran) == (8, 8)


def test_close_models_run_every_feed_and_match_a_full_comparison():
    ref = reference()
    models = [noisy(0.01, 37.0), noisy(0.01, 53.0)]   # same error size, different per feed
    contenders, winner = race(ref, models, min_samples=8)
    assert [c.ran for c in contenders] == [32, 32] and not any(c.dropped for c in contenders)
    for model, contender in zip(models, contenders):
        assert contender.snr() == pytest.approx(ref.score(model)["snr_db"], abs=1e-6)
    full = compare(parse(IDENTITY), models[0], ref.feeds)
    assert contenders[0].snr() == pytest.approx(full["snr_db"], abs=1e-6)
    first, second = contenders
    assert second.margin(first) == pytest.approx(second.snr() - first.snr(), abs=1e-9)
    assert winner is (second if second.score() > first.score() else first)


def test_no_early_stop_with_z_0():
    ref = reference()
    contenders, winner = race(ref, [noisy(0.01), noisy(0.3)], z=0)
    assert [c.ran for c in contenders] == [32, 32] and winner is contenders[0]
    contenders, winner = race(ref, [noisy(0.3), noisy(0.01)], z=0)
    assert [c.ran for c in contenders] == [32, 32] and winner is contenders[1]
    assert contenders[1].margin(contenders[0]) > 25


def test_penalties_decide_at_the_end_and_never_stop_a_variant_alone():
    ref = reference()
    # 0.01 vs 0.012: 1.6 dB apart; a 10 dB penalty on the better one makes it the loser, but only
    # once every feed ran: it is ahead in SNR
    (worse, better), winner = race(ref, [noisy(0.012), noisy(0.01)], penalties=[0.0, 10.0], min_samples=8)
    assert winner is worse and not better.dropped and better.ran == 32
    assert better.score() == pytest.approx(better.snr() - 10)
    (better, worse), winner = race(ref, [noisy(0.01), noisy(0.012)], penalties=[10.0, 0.0], min_samples=8)
    assert winner is worse and worse.margin(better) > 8 and worse.ran == 32
    # identical outputs: no spread, and the penalty must not stop either (it settles the tie at the end)
    (first, second), winner = race(ref, [noisy(0.01), noisy(0.01)], penalties=[0.05, 0.0], min_samples=8)
    assert winner is second and (first.ran, second.ran) == (32, 32) and not first.dropped


def test_a_lone_contender_runs_the_first_block_only():
    ref = reference()
    (only,), winner = race(ref, [noisy(0.01)], min_samples=8)
    assert winner is only and only.ran == 8 and only.snr() == pytest.approx(ref.score(noisy(0.01))["snr_db"], abs=3)


def test_a_model_that_cannot_run_raises():
    broken = parse(IDENTITY.replace("y = Identity(x)", "z = Identity(x)").replace("(float[1, 256] y)", "(float[1, 256] z)"))
    with pytest.raises(Exception, match="reference output"):
        Contender(reference(12), broken)


BOXES_AND_SCORES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 16] x, float[1, 2, 16] c) => (float[1, 6, 16] y) <float k = {100.0}, float d = {%s}>
{
  b = Mul(x, k)
  s = Sigmoid(c)
  t = Add(s, d)
  y = Concat <axis = 1> (b, t)
}
"""


def test_split_scores_contenders_by_their_worst_component():
    """Scores 1 % off beside boxes 100x larger: the output's SNR hides them, its components do not."""
    from qpasses.evaluation.objective import Objective
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(0, 1, (1, 4, 16)).astype(np.float32),
              "c": rng.normal(0, 1, (1, 2, 16)).astype(np.float32)} for _ in range(8)]
    float_model, test_model = parse(BOXES_AND_SCORES % "0.0"), parse(BOXES_AND_SCORES % "0.01")
    whole = Contender(Reference.run(float_model, feeds), test_model)
    split = Contender(Reference.run(float_model, feeds).split(Objective("snr", model=float_model)), test_model)
    whole.advance(8), split.advance(8)
    scores = compare(float_model, test_model, feeds, objective=Objective("snr", model=float_model))["components"]
    assert whole.errors.shape == (8, 1) and split.errors.shape == (8, 2)
    assert split.snr() == pytest.approx(min(scores.values())) and split.snr() < 40 < whole.snr()
