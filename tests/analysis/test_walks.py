"""search-precision's walks over promotion candidates (qpasses.analysis.walks), on made-up scores."""
from qpasses.analysis.walks import EightBitShare, Walk, aimed, fewest


def _walk(scores, budget=30):
    asked = []

    def check(promoted):
        asked.append(frozenset(promoted))
        return scores(set(promoted))

    return Walk(check, budget, 1, {frozenset(): scores(set())}), asked


def _one_op_each(names, keep):
    """Name i alone is read by weighted op i; every op is 8-bit."""
    return EightBitShare({n: {i} for i, n in enumerate(names)}, len(names), len(names), keep)


def test_fewest_bisects_then_gives_back():
    walk, _ = _walk(lambda s: 10.0 + 5 * ("c" in s) + ("a" in s))
    assert fewest(walk, ["a", "b", "c", "d"], 14.0) == (["c"], 15.0)


def test_fewest_keeps_the_best_seen_within_its_candidates_when_none_meets():
    walk, _ = _walk(lambda s: 10.0 + len(s))
    walk.seen[frozenset({"z"})] = 99.0   # scored for another walk: not a candidate here
    assert fewest(walk, ["a", "b"], 50.0) == (["a", "b"], 12.0)


def test_aim_takes_the_order_that_meets_it_and_stays_within_the_share():
    """The local order leads with a and b, which do nothing; the graph order leads with c, which
    meets the aim alone. The share allows 1 of 5 ops out of 8 bits: d is never tried."""
    names = ["a", "b", "c", "d", "e"]
    walk, asked = _walk(lambda s: 20.0 + 6 * ("c" in s) + 10 * ("d" in s))
    promoted, reached, order = aimed(walk, [names, ["c", "d", "a", "b", "e"]], [], 25.0, _one_op_each(names, 0.8))
    assert (promoted, reached, order) == (["c"], 26.0, 1)
    assert all("d" not in key for key in asked)


def test_aim_comes_closest_when_it_cannot_be_met():
    names = ["a", "b", "c"]
    walk, _ = _walk(lambda s: 20.0 + len(s))
    promoted, reached, order = aimed(walk, [names, names[::-1]], [], 30.0, _one_op_each(names, 0.3))
    assert (promoted, reached, order) == (["a", "b"], 22.0, 0)


def test_aim_keeps_the_target_search_promotions_first():
    names = ["a", "b", "c"]
    walk, _ = _walk(lambda s: 10.0 + 3 * len(s))
    promoted, reached, _ = aimed(walk, [names[::-1]], ["a"], 16.0, _one_op_each(names, 0.0))
    assert promoted[0] == "a" and reached >= 16.0


def test_aim_does_nothing_when_the_target_search_used_the_share_or_the_budget_is_spent():
    names = ["a", "b", "c", "d"]
    scores = lambda s: 10.0 + len(s)
    walk, asked = _walk(scores)
    assert aimed(walk, [names], ["a", "b"], 20.0, _one_op_each(names, 0.5)) == (["a", "b"], 12.0, -1)
    walk, asked = _walk(scores, budget=1)
    assert aimed(walk, [names], [], 20.0, _one_op_each(names, 0.0)) == ([], 10.0, -1)
    assert asked == []


def test_fewest_leaves_the_reserve_and_aim_spends_it_on_whole_heads():
    """The target search stops giving members back with 2 evaluations left; the aim then scores
    each order's whole head once (no budget for a bisection) and keeps the better."""
    names = ["a", "b", "c", "d"]
    walk, asked = _walk(lambda s: 10.0 + len(s) + 3 * ("d" in s), budget=6)
    chosen, reached = fewest(walk, names, 11.0, reserve=2)
    assert walk.left == 2 and reached >= 11.0
    assert chosen == ["a"]
    promoted, reached, order = aimed(walk, [names, names[::-1]], chosen, 30.0, _one_op_each(names, 0.25))
    assert walk.left == 0 and (promoted, reached, order) == (["a", "d", "c"], 16.0, 1)


def test_the_share_counts_multiply_accumulates_not_ops():
    """Op 0 does 90 % of the work: promoting its reader leaves 10 % of the cost 8-bit, under any
    share, while promoting the three light ones keeps 90 %."""
    share = EightBitShare({"heavy": {0}, "a": {1}, "b": {2}, "c": {3}}, 100.0, 100.0, 0.8,
                          {0: 90.0, 1: 10 / 3, 2: 10 / 3, 3: 10 / 3})
    assert share.cap(["heavy", "a"]) == 0 and share.cap(["a", "b", "c", "heavy"]) == 3
    assert share.lost(["a", "b"]) == 20 / 3


def test_fewest_gives_back_the_costliest_promotions_first_and_skips_free_ones():
    """Any two of the four meet the target (the bisection starts with all four). The costliest in
    float (b and d) go back to 8 bits first, whatever their rank; c costs nothing, so no evaluation
    is spent giving it back."""
    names = ["a", "b", "c", "d"]
    share = EightBitShare({n: {i} for i, n in enumerate(names)}, 100.0, 100.0, 0.8,
                          {0: 10.0, 1: 60.0, 2: 0.0, 3: 30.0})
    walk, asked = _walk(lambda s: 10.0 + 2 * len(s))
    assert fewest(walk, names, 14.0, start=3, share=share) == (["a", "c"], 14.0)
    given_back = [key for key in asked if key != frozenset(names)]
    assert given_back[0] == frozenset({"a", "c"})   # b and d, the costliest half, back at once
    assert all("c" in key for key in given_back)   # c alone is never given back


def test_fewest_without_costs_gives_back_the_least_sensitive_first():
    walk, asked = _walk(lambda s: 10.0 + 2 * len(s))
    assert fewest(walk, ["a", "b", "c", "d"], 14.0, start=3) == (["a", "b"], 14.0)
    assert asked[1] == frozenset({"a", "b"})


def test_a_member_whose_ops_another_keeps_float_saves_nothing():
    """a and b both read op 0: giving a back alone leaves op 0 float."""
    share = EightBitShare({"a": {0}, "b": {0}, "c": {1}}, 10.0, 10.0, 0.8, {0: 6.0, 1: 4.0})
    assert share.saved(["a", "b", "c"], ["a"]) == 0 and share.saved(["a", "b", "c"], ["a", "b"]) == 6.0


def test_giving_back_stops_after_four_failures_in_a_row():
    """Every one of the 16 is needed: after the bisection, four failed give-backs end the search."""
    names = [f"n{i}" for i in range(16)]
    walk, asked = _walk(lambda s: 10.0 + 10 * (len(s) == 16))
    assert fewest(walk, names, 14.0) == (names, 20.0)
    bisection = 4   # heads of 8, 12, 14, 15
    assert len(asked) == 1 + bisection + 4


def test_a_float_weight_whose_op_runs_float_anyway_still_costs_its_size():
    """The input x and the weight w both take op 0 out: giving either back alone saves no latency,
    but w's values would stay float, so it goes back first; the activation t saves neither and is
    never tried alone."""
    share = EightBitShare({"x": {0}, "w": {0}, "t": set()}, 10.0, 10.0, 0.8, {0: 10.0}, {"w": 1000})
    assert share.order(["x", "t", "w"]) == ["w", "x", "t"]
    assert not share.negligible(["x", "w", "t"], ["w"]) and share.negligible(["x", "w", "t"], ["t"])
    walk, asked = _walk(lambda s: 10.0 + 5 * ("x" in s) + ("w" in s))
    assert fewest(walk, ["x", "w", "t"], 14.0, start=2, share=share) == (["x", "t"], 15.0)
    assert frozenset({"x", "w"}) not in asked


def test_aim_takes_a_head_the_checks_cannot_tell_from_the_chosen_and_the_costlier_of_equals():
    """Scores carry a margin of 3: the graph head (d, c) reads 2 below the chosen and the ranking's
    head (a) 1 below, both within the margins; of these equals the one keeping more ops float wins
    and, short of the aim, is kept whole. A margin of 0.4 makes both measurably lower: nothing."""
    names = ["a", "b", "c", "d"]
    scores = lambda s: 20.0 - 2 * ("d" in s) - ("a" in s)
    for margin, expected in ((3.0, (["d", "c"], 18.0, 1)), (0.4, ([], 20.0, -1))):
        walk, _ = _walk(scores)
        walk._upper = lambda promoted: scores(set(promoted)) + 2 * margin
        share = EightBitShare({"a": {0}, "b": {1}, "c": {2}, "d": {3}}, 100.0, 100.0, 0.5,
                              {0: 5.0, 1: 30.0, 2: 20.0, 3: 25.0})
        assert aimed(walk, [names, ["d", "c", "b", "a"]], [], 30.0, share) == expected
