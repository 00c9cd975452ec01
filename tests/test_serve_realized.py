"""What the engine's round policy (`serve/policy.py`) learns from the dispatches that served: what a
method `realized` of its model and forgetting it, the occupancy of K-round dispatches, dispatches
cut short by arrivals. On made-up timings: no model, no compile."""

from dmtp_jax.serve.policy import LoadPolicy
from dmtp_jax.serve.realized import REALIZED_DISPATCHES


def weighed(ratio: float, dispatches: int) -> float:
    """What a method that realized `ratio` of its model over `dispatches` served dispatches counts as:
    in proportion to them until `REALIZED_DISPATCHES`."""
    return 1 + (ratio - 1) * min(1, dispatches / REALIZED_DISPATCHES)


def test_what_a_method_realizes_of_its_model_corrects_its_estimate():
    """dmtp is modelled 10 % above ar at 8 rows and serves, but its dispatches realize 75 % of their
    modelled rate (its rows idle between requests, a busy host): that counts from its first dispatch,
    in proportion to them (`weighed`), and once it brings dmtp's estimate 5 % below ar's (not yet
    measured: taken at its model), within `REALIZED_DISPATCHES` dispatches, ar serves (after a
    confirming dispatch: its time was taken long before). Before, dmtp served 32 dispatches on its
    model first. dmtp's realization at 8 rows is its own: on one row its model stands."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.4}, refresh_every=1000)
    policy.observe("dmtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4.4)     # trusted
    for bucket, ar_s, dmtp_s in ((8, 0.004, 0.016), (1, 0.002, 0.004)):
        policy.observe("ar", bucket, rounds=1, seconds=ar_s, row_rounds=0, committed=0)
        policy.observe("dmtp", bucket, rounds=1, seconds=dmtp_s, row_rounds=0, committed=0)
    modelled = policy.modelled(8, 8)
    assert abs(modelled["dmtp"] / modelled["ar"] - 1.1) < 0.01
    # ar serves once 1.05 x dmtp's estimate is at most ar's: weighed(0.75, n) <= 1 / (1.05 x 1.1)
    first = next(n for n in range(1, 100) if 1.05 * modelled["dmtp"] * weighed(0.75, n) <= modelled["ar"])
    assert 1 < first <= REALIZED_DISPATCHES
    chosen = []
    for _ in range(first + 2):
        m = chosen.append(policy.choose(8, 8)) or chosen[-1]
        tokens = 8 * (4.4 if m == "dmtp" else 1.0)
        policy.observe_served(m, 8, tokens, tokens / (0.75 * policy.describe()["rounds_rate"]))
    assert chosen == ["dmtp"] * first + ["ar"] * 2, chosen
    assert abs(policy.realized("dmtp", 8) - weighed(0.75, first)) < 1e-9 and policy.realized("dmtp", 1) == 1.0
    assert policy.choose(1, 1) == "dmtp"


def test_what_a_method_realized_is_forgotten_after_others_serve():
    """dmtp realized 75 % of its model at 8 rows and gave way to ar (10 % below dmtp's model); once ar
    has served there, since dmtp's last dispatch, the seconds of `REALIZED_FORGET` of dmtp's
    dispatches, dmtp serves on its model again (a spell that held it back is not held against it for
    good) and what it realizes then counts anew. ar's dispatches on one row (where it serves) forget
    nothing at 8 rows, however long they take."""
    from dmtp_jax.serve.realized import REALIZED_FORGET
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.4}, refresh_every=10_000)
    policy.observe("dmtp", 0, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4.4)     # trusted
    round_s = {("ar", 1): 0.002, ("ar", 8): 0.004, ("dmtp", 1): 0.016, ("dmtp", 8): 0.016}
    for (method, bucket), seconds in round_s.items():
        policy.observe(method, bucket, rounds=1, seconds=seconds, row_rounds=0, committed=0)

    def serve(rows, share):
        m = policy.choose(rows, rows)
        tokens = rows * (4.4 if m == "dmtp" else 1.0)
        policy.observe(m, rows, rounds=1, seconds=round_s[(m, rows)], row_rounds=rows, committed=tokens)
        policy.observe_served(m, rows, tokens, tokens / (share[m] * policy.describe()["rounds_rate"]))
        return m

    chosen = []
    while not chosen or chosen[-1] == "dmtp":
        chosen.append(serve(8, {"dmtp": 0.75, "ar": 1.0}))
    served = len(chosen) - 1
    assert 1 < served <= REALIZED_DISPATCHES, chosen
    held = weighed(0.75, served)
    dmtp_s, ar_s = (8 * t / (share * policy.modelled(8, 8)[m]) for m, t, share in (("dmtp", 4.4, 0.75), ("ar", 1, 1)))
    one_row_s = 1 / (0.6 * policy.modelled(1, 1)["ar"])        # ar realizes 60 % on one row: still ahead
    for _ in range(int(1.1 * REALIZED_FORGET * dmtp_s / one_row_s)):
        assert serve(1, {"dmtp": 1.0, "ar": 0.6}) == "ar"
    assert abs(policy.realized("dmtp", 8) - held) < 1e-9
    dispatches = int(REALIZED_FORGET * dmtp_s / ar_s)     # ar's first at 8 confirmed its time
    chosen = [serve(8, {"dmtp": 0.75, "ar": 1.0}) for _ in range(dispatches)]
    assert set(chosen) == {"ar"} and abs(policy.realized("dmtp", 8) - held) < 1e-9
    assert serve(8, {"dmtp": 0.75, "ar": 1.0}) == "ar" and policy.realized("dmtp", 8) == 1.0
    assert abs(policy.realized("ar", 8) - 1.0) < 1e-9 and serve(8, {"dmtp": 0.75, "ar": 1.0}) == "dmtp"


def test_occupancy_prior_follows_requests_until_a_dispatch_measures_it():
    """A K-round dispatch of dmtp over 8 rows: before any request finished its occupancy is 1 (asked
    for at warm-up, too); once requests of 64 tokens finish at tau 4 it is a request's 16 rounds over
    those plus (K - 1) / 2 idle ones at its end and K while its successor waits for the next dispatch
    (before, those K were left out: 0.91 where the bench's rows ran 0.70-0.77); a served 4-round
    dispatch then weighs in as one of 1 +
    `PRIOR_ROW_ROUNDS` samples. Plain rounds and one-round dispatches run every row round."""
    from dmtp_jax.serve.policy import PRIOR_ROW_ROUNDS
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.0}, refresh_every=10_000)
    for method, seconds in (("ar", 0.004), ("dmtp", 0.010)):
        policy.observe(method, 8, rounds=1, seconds=seconds, row_rounds=0, committed=0)
    assert policy.occupancy("dmtp", 8, most=4) == 1.0
    policy.observe_output(64)
    prior = 16 / (16 + 1.5 + 4)
    assert abs(policy.occupancy("dmtp", 8, most=4) - prior) < 1e-12
    assert policy.occupancy("dmtp", 8, most=1) == policy.occupancy("ar", 8, most=4) == 1.0
    policy.observe("dmtp", 0, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4)     # trusted
    assert policy.choose(8, 8, most=4) == "dmtp" and policy.describe()["rounds"] == 4
    policy.observe("dmtp", 8, rounds=4, seconds=0.048, row_rounds=16, committed=64)         # half the row rounds
    mean = (PRIOR_ROW_ROUNDS * prior + 0.5) / (PRIOR_ROW_ROUNDS + 1)
    assert abs(policy.occupancy("dmtp", 8, most=4) - mean) < 1e-12
    policy.observe_output(64)
    assert abs(policy.occupancy("dmtp", 8, most=4) - mean) < 1e-12


def test_dispatches_cut_short_by_arrivals_count_in_what_a_method_realizes():
    """dmtp beats ar at 8 rows in 4-round dispatches (12 ms a round against its 20 ms alone) but not
    in 1-round ones; arrivals keep cutting its dispatches to one round (`idle=False`), so what it
    realizes of its 4-round model is 0.6 and, within `REALIZED_DISPATCHES` dispatches, ar serves:
    the methods are compared at the dispatch they would run while nobody waits, whatever cuts them
    short."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.4}, refresh_every=10_000)
    policy.observe("dmtp", 0, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4.4)     # trusted
    one, four = {"ar": 0.004, "dmtp": 0.020}, {"ar": 0.004, "dmtp": 0.012}
    for m in one:
        policy.observe(m, 8, rounds=1, seconds=one[m], row_rounds=0, committed=0)
        policy.observe(m, 8, rounds=4, seconds=4 * four[m], row_rounds=0, committed=0)
    chosen = []
    while not chosen or chosen[-1] == "dmtp":
        m = policy.choose(8, 8, most=4, idle=False)
        assert policy.describe()["rounds"] == 1 and len(chosen) <= REALIZED_DISPATCHES, chosen
        chosen.append(m)
        tokens = 8 * (4.4 if m == "dmtp" else 1.0)
        policy.observe(m, 8, rounds=1, seconds=one[m], row_rounds=8, committed=tokens)
        policy.observe_served(m, 8, tokens, one[m])
    assert len(chosen) > 2, chosen
    assert abs(policy.realized("dmtp", 8) - weighed(0.6, len(chosen) - 1)) < 1e-9
    assert policy.choose(8, 8, most=4) == "ar" and policy.describe()["rounds"] == 4


def test_rows_that_wait_for_their_next_request_count_against_what_a_method_realizes():
    """A closed loop of 8 clients. mtp's rows end at different rounds and each waits out dispatches
    for its client's next request, so its dispatches run 8, 2, 2, 2 rows in turn (the engine holds
    only its running requests meanwhile); ar's rows end, and are refilled, together. At the rows
    running mtp's model wins (2 x 4 tokens in 10 ms against 2 in 4 ms), but it serves 3.5 rows on
    average, 1400 tok/s against ar's 2000 at all 8. What it realizes is taken against the load (the
    most requests held over the last `LOAD_CHOICES` choices), so it falls to its floor (0.5) and ar
    serves within `REALIZED_DISPATCHES` dispatches. Before, it was taken at the running rows: mtp
    realized all of its model and served on."""
    from dmtp_jax.serve.realized import REALIZED_SPAN
    policy = LoadPolicy({"ar": 1, "mtp": 5}, {"mtp": 4.0}, refresh_every=10_000)
    policy.observe("mtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4)      # trusted
    for method, seconds in (("ar", 0.004), ("mtp", 0.010)):
        policy.observe(method, 8, rounds=1, seconds=seconds, row_rounds=0, committed=0)
    chosen = []
    while not chosen or chosen[-1] == "mtp":
        rows = 8 if len(chosen) % 4 == 0 else 2
        chosen.append(policy.choose(rows, 8))
        assert policy.describe()["load"] == 8 and len(chosen) <= REALIZED_DISPATCHES, chosen
        if chosen[-1] == "mtp":
            policy.observe("mtp", 8, rounds=1, seconds=0.010, row_rounds=rows, committed=rows * 4)
            policy.observe_served("mtp", 8, rows * 4, 0.010)
    assert len(chosen) > 2, chosen
    assert abs(policy.realized("mtp", 8) - weighed(1 - REALIZED_SPAN, len(chosen) - 1)) < 1e-9


def test_an_unmeasured_speculative_method_counts_its_successors_wait():
    """ar serves 8 rows in 4-round dispatches (4 ms a round); dmtp (12 ms, tau 4, requests of 64
    tokens) has run no K-round dispatch there. Its occupancy prior is a request's 16 rounds over 16 +
    1.5 + 4 (0.74): 8 x 4 x 0.74 / 12 ms = 1.98 tokens per ms against ar's 2.0, so ar keeps serving
    and its rows stay in step. Before, the prior was 16 / 17.5 (0.91, 2.44 tokens per ms): dmtp
    replaced ar, and in the bench its rows ran 0.70-0.77 of the load's row rounds, ar's 0.82 after."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.0}, refresh_every=10_000)
    policy.observe("dmtp", 0, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4)     # trusted
    for method, seconds in (("ar", 0.004), ("dmtp", 0.012)):
        policy.observe(method, 8, rounds=1, seconds=seconds, row_rounds=0, committed=0)
        policy.observe(method, 8, rounds=4, seconds=4 * seconds, row_rounds=0, committed=0)
    policy.observe_output(64)
    for _ in range(40):
        assert policy.choose(8, 8, most=4) == "ar", policy.describe()
        policy.observe("ar", 8, rounds=4, seconds=0.016, row_rounds=32, committed=32)
    assert abs(policy.describe()["estimates"]["dmtp"] / 1000 - 8 * 4 * (16 / 21.5) / 12) < 1e-9


def test_occupancy_is_taken_against_the_load_and_speculative_methods_share_it():
    """mtp serves 4-round dispatches at 8 rows in a closed loop of 8 clients: its rows end at
    different rounds and wait for their successors, so its dispatches run 8, 6, 6, 6 rows in turn.
    Its occupancy is taken against the load (8), not the rows running at the choice, so it falls
    toward their mean, 0.81; dmtp, never served there, starts from it (its rows would wait alike);
    ar's stays 1. Before, every sample was 1 (the rows ran every round of their dispatch)."""
    policy = LoadPolicy({"ar": 1, "mtp": 5, "dmtp": 8}, {"mtp": 4.0, "dmtp": 4.0}, refresh_every=10_000)
    for method in ("mtp", "dmtp"):
        policy.observe(method, 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4)    # trusted
    for method, seconds in (("ar", 0.010), ("mtp", 0.012), ("dmtp", 0.050)):
        for k in (1, 4):
            policy.observe(method, 8, rounds=k, seconds=k * seconds, row_rounds=0, committed=0)
    for i in range(60):
        rows = 8 if i % 4 == 0 else 6
        assert policy.choose(rows, 8, most=4) == "mtp" and policy.describe()["rounds"] == 4
        policy.observe("mtp", 8, rounds=4, seconds=0.048, row_rounds=4 * rows, committed=16 * rows)
    assert abs(policy.occupancy("mtp", 8, most=4) - 0.8125) < 0.02, policy.occupancy("mtp", 8, most=4)
    assert policy.occupancy("dmtp", 8, most=4) == policy.occupancy("mtp", 8, most=4)
    assert policy.occupancy("ar", 8, most=4) == 1.0
