"""The engine's round policy (`serve/policy.py`), on made-up timings: no model, no compile."""

from dmtp_jax.serve.policy import LoadPolicy

SLOTS = {"ar": 1, "mtp": 5, "dmtp": 8}


def run(policy, timing, tau, rows=1, bucket=1, choices=200):
    """Drives `policy` for `choices` rounds with seconds per round `timing(method, i)` and tokens
    per row round `tau[method]`; returns the methods chosen."""
    chosen = []
    for i in range(choices):
        m = policy.choose(rows, bucket)
        chosen.append(m)
        policy.observe(m, bucket, rounds=1, seconds=timing(m, i), row_rounds=rows, committed=rows * tau[m])
    return chosen


def test_one_slow_first_sample_does_not_lock_in_plain_decoding():
    """dmtp's timing round lands in a slow spell (10x): ar wins at first, but the refreshes outvote
    the outlier and dmtp (4 tokens a round at 2x ar's cost) serves the rest."""
    policy = LoadPolicy(SLOTS, {"dmtp": 4.0, "mtp": 2.0}, refresh_every=8)
    base = {"ar": 0.010, "mtp": 0.015, "dmtp": 0.020}
    chosen = run(policy, lambda m, i: base[m] * (10 if (m == "dmtp" and i < 3) else 1),
                 {"ar": 1, "mtp": 2, "dmtp": 4})
    assert chosen[:3] == ["ar", "mtp", "dmtp"]                  # each timed once
    assert "dmtp" not in chosen[3:7]                             # the outlier made mtp look best
    assert chosen[7] == "dmtp"                                   # the first refresh: its tau rests on 1 row round
    assert chosen[-100:].count("dmtp") >= 85, chosen[-100:]      # then dmtp, but for the refreshes
    assert policy.describe()["why"] in ("highest estimated tok/s", "refreshing ar's estimate at 1 rows",
                                        "refreshing mtp's estimate at 1 rows")


def test_plain_decoding_is_retimed_when_its_estimate_goes_stale():
    """ar's timing round was slow (a busy machine), dmtp wins; ar's refreshes find it fast again
    once the acceptance drops, and ar takes over."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.0}, refresh_every=8, refresh_share=1.0)
    tau = {"ar": 1, "dmtp": 4}
    chosen = run(policy, lambda m, i: 0.050 if m == "ar" else 0.020, tau, choices=40)
    assert chosen[2:].count("dmtp") >= 34, chosen
    tau["dmtp"] = 1                                             # text where drafts stop landing
    chosen = run(policy, lambda m, i: 0.010 if m == "ar" else 0.020, tau, choices=120)
    assert chosen[-40:].count("ar") >= 35, chosen[-40:]


def test_refreshes_take_at_most_their_share_of_the_serving_time():
    """At 32 rows ar serves (8 ms a round); a refresh of dmtp costs its 72 ms round and the 46 ms
    catch-up of the plain rounds' rows before it: once its acceptance is trusted (two refreshes of 32
    row rounds), the share keeps such refreshes to 2 % of the time, where every 32 choices would
    spend a third of it. On one row dmtp serves (20 ms a round) and a refresh of ar (10 ms) is cheap:
    it runs every 32 choices."""
    def drive(policy, rows, seconds, tau, choices=1000):
        chosen, previous = [], None
        for _ in range(choices):
            m = policy.choose(rows, rows)
            chosen.append(m)
            catch_up = 0.046 if m == "dmtp" and previous == "ar" else 0.0
            policy.observe(m, rows, rounds=1, seconds=seconds[m], row_rounds=rows, committed=rows * tau[m],
                           catch_up_s=catch_up)
            previous = m
        return chosen

    dear = {"ar": 0.008, "dmtp": 0.072}
    for share, most, least in ((1.0, 40, 25), (0.02, 4, 3)):
        policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0}, refresh_share=share)
        policy.observe("ar", 32, rounds=1, seconds=dear["ar"], row_rounds=0, committed=0)
        policy.observe("dmtp", 32, rounds=1, seconds=dear["dmtp"], row_rounds=0, committed=0)
        chosen = drive(policy, 32, dear, {"ar": 1, "dmtp": 5})
        assert least <= chosen.count("dmtp") <= most, (share, chosen.count("dmtp"))
    assert policy.refresh_s <= 2 * 0.072 + 0.046 + 0.02 * policy.serving_s     # the two trusting refreshes, then 2 %
    cheap = {"ar": 0.010, "dmtp": 0.020}
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0})
    policy.observe("ar", 1, rounds=1, seconds=cheap["ar"], row_rounds=0, committed=0)
    policy.observe("dmtp", 1, rounds=1, seconds=cheap["dmtp"], row_rounds=0, committed=0)
    chosen = drive(policy, 1, cheap, {"ar": 1, "dmtp": 5})
    assert chosen.count("ar") == 1000 // 32, chosen.count("ar")


def test_refreshes_of_several_methods_share_one_budget():
    """ar serves at 32 rows; dmtp (72 ms round, 46 ms catch-up) and mtp (40 ms, 46 ms) are both dear to
    refresh: once both are trusted, their refreshes together stay within `REFRESH_SHARE` of the
    serving seconds (within one refresh's cost), each still refreshed."""
    from dmtp_jax.serve.policy import REFRESH_SHARE
    seconds, tau = {"ar": 0.008, "dmtp": 0.072, "mtp": 0.040}, {"ar": 1, "dmtp": 5, "mtp": 2}
    policy = LoadPolicy({"ar": 1, "dmtp": 8, "mtp": 2}, {"dmtp": 5.0, "mtp": 2.0})
    for m in seconds:
        policy.observe(m, 32, rounds=1, seconds=seconds[m], row_rounds=0, committed=0)
    chosen, previous = [], "ar"
    for i in range(4000):
        if i == 200:
            refresh_s, serving_s = policy.refresh_s, policy.serving_s
        m = policy.choose(32, 32)
        chosen.append(m)
        catch_up = 0.046 if m != "ar" and previous == "ar" else 0.0
        policy.observe(m, 32, rounds=1, seconds=seconds[m], row_rounds=32, committed=32 * tau[m], catch_up_s=catch_up)
        previous = m
    later = chosen[200:]
    assert later.count("dmtp") >= 1 and later.count("mtp") >= 1 and later.count("ar") > 3780, later
    spent = policy.refresh_s - refresh_s
    assert spent <= REFRESH_SHARE * (policy.serving_s - serving_s) + 0.072 + 0.046, (spent, policy.serving_s)


def test_seconds_served_at_another_bucket_buy_no_refresh():
    """dmtp serves one row for 100 s; then ar serves 32 rows, where a dmtp refresh (72 ms round, 46 ms
    catch-up) is dear: it waits until 32 rows have been served for what the share pays (the old code
    counted the 100 s at one row and refreshed 0.41 s in)."""
    from dmtp_jax.serve.policy import REFRESH_SHARE
    seconds = {("ar", 1): 0.010, ("dmtp", 1): 0.020, ("ar", 32): 0.008, ("dmtp", 32): 0.072}
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0})
    chosen = run(policy, lambda m, i: seconds[(m, 1)], {"ar": 1, "dmtp": 5}, choices=5100)
    assert chosen[-100:].count("dmtp") > 90 and policy.serving_s > 100
    policy.observe("ar", 32, rounds=1, seconds=seconds[("ar", 32)], row_rounds=0, committed=0)
    policy.observe("dmtp", 32, rounds=1, seconds=seconds[("dmtp", 32)], row_rounds=0, committed=0)
    free = 0.072 / REFRESH_SHARE        # the seconds served at 32 rows that pay for dmtp's first refresh (its
                                        # round: the bucket's catch-up time is unknown until one ran)
    previous, at_32 = "ar", []
    while sum(seconds[(m, 32)] for m in at_32) < 1.5 * free:
        m = policy.choose(32, 32)
        at_32.append(m)
        catch_up = 0.046 if m == "dmtp" and previous == "ar" else 0.0
        policy.observe(m, 32, rounds=1, seconds=seconds[(m, 32)], row_rounds=32,
                       committed=32 * (5 if m == "dmtp" else 1), catch_up_s=catch_up)
        previous = m
    first = at_32.index("dmtp")
    assert seconds[("ar", 32)] * first >= free, (first, free)
    assert at_32.count("dmtp") == 1, at_32.count("dmtp")


def test_each_bucket_is_timed_on_its_own():
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 3.0})
    tau = {"ar": 1, "dmtp": 3}
    run(policy, lambda m, i: 0.01 if m == "ar" else 0.02, tau, rows=1, bucket=1, choices=10)
    assert policy.choose(8, 8) == "ar" and policy.describe()["why"] == "timing ar at 8 rows"
    assert set(policy.round_s) == {("ar", 1, 1), ("dmtp", 1, 1)}
    # at 8 rows dmtp's round costs 4x ar's: 3 tokens do not pay for it
    run(policy, lambda m, i: 0.01 if m == "ar" else 0.04, tau, rows=8, bucket=8, choices=30)
    assert policy.choose(8, 8) == "ar" and policy.choose(1, 1) == "dmtp"


def test_the_hosts_time_per_round_favours_fewer_rounds():
    """ar 10 ms a round, dmtp 30 ms for 2.5 tokens: ar is faster on the device alone, but with 20 ms
    of host work around every round (committing, streaming) dmtp's fewer rounds win."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 2.5})
    policy.observe("ar", 4, rounds=1, seconds=0.010, row_rounds=0, committed=0)      # warm-up's timings
    policy.observe("dmtp", 4, rounds=1, seconds=0.030, row_rounds=0, committed=0)
    assert policy.choose(4, 4) == "ar" and policy.tau["dmtp"] == 2.5
    policy.observe_host(4, 0.020)
    assert policy.choose(4, 4) == "dmtp" and policy.describe()["why"] == "highest estimated tok/s"
    assert policy.choose(4, 8) == "ar" and policy.describe()["why"] == "timing ar at 8 rows"


def test_rounds_per_dispatch_stay_within_the_dispatch_bound():
    policy = LoadPolicy({"ar": 1, "dmtp": 8})
    assert policy.rounds("ar", 1, 4) == 1                   # not timed yet
    policy.observe("ar", 1, rounds=1, seconds=0.02, row_rounds=1, committed=1)
    policy.observe("dmtp", 1, rounds=1, seconds=0.07, row_rounds=1, committed=3)
    assert policy.rounds("ar", 1, 4) == 4 and policy.rounds("ar", 1, 1) == 1
    assert policy.rounds("dmtp", 1, 4) == 1                 # 4 x 70 ms: past DISPATCH_S
    assert policy.rounds("ar", 8, 4) == 1


def test_acceptance_weighs_row_rounds_so_one_unlucky_round_does_not_flip_the_choice():
    """tau is a mean over row rounds: one refresh round of one row that accepted nothing barely moves
    dmtp's, 32 row rounds of it do."""
    policy = LoadPolicy(SLOTS)
    for m, t in (("ar", 0.02), ("mtp", 0.04), ("dmtp", 0.04)):
        policy.observe(m, 1, rounds=1, seconds=t, row_rounds=0, committed=0)
    policy.observe("mtp", 1, rounds=1, seconds=0.04, row_rounds=40, committed=188)     # tau 4.7
    policy.observe("dmtp", 1, rounds=1, seconds=0.04, row_rounds=40, committed=220)    # tau 5.5
    assert policy.choose(1, 1) == "dmtp"
    policy.observe("dmtp", 1, rounds=1, seconds=0.04, row_rounds=1, committed=1)
    assert policy.choose(1, 1) == "dmtp" and policy.tau["dmtp"] > 5.0
    policy.observe("dmtp", 1, rounds=1, seconds=0.04, row_rounds=32, committed=32)
    assert policy.choose(1, 1) == "mtp"


def test_one_unlucky_first_round_does_not_replace_the_prior():
    """The trace that cost auto a fifth of its tok/s at one client: the same warm-up times for mtp and
    dmtp, dmtp's first live round accepts 2 tokens (its true tau 6.6 against mtp's 4.6). The prior
    weighs as several row rounds, so dmtp keeps its lead and serves the workload."""
    policy = LoadPolicy({"ar": 1, "mtp": 5, "dmtp": 8, "lookup": 8}, refresh_every=32)
    for m, t in (("ar", 0.012), ("mtp", 0.022), ("dmtp", 0.024), ("lookup", 0.013)):
        policy.observe(m, 1, rounds=1, seconds=t, row_rounds=0, committed=0)      # warm-up's timings
    tau = {"ar": 1, "mtp": 4.6, "dmtp": 6.6, "lookup": 1.1}      # lookup's prior (4.0) costs a few rounds
    first = [True]

    def committed(m):
        if m == "dmtp" and first[0]:
            first[0] = False
            return 2.0
        return tau[m]

    chosen = []
    for _ in range(120):
        m = policy.choose(1, 1)
        chosen.append(m)
        policy.observe(m, 1, rounds=1, seconds={"ar": 0.012, "mtp": 0.022, "dmtp": 0.024, "lookup": 0.013}[m],
                       row_rounds=1, committed=committed(m))
    after = [m for m in chosen[chosen.index("dmtp") + 1:] if m != "lookup"]
    assert after[0] == "dmtp", chosen[:16]                          # the unlucky round did not hand it to mtp
    assert chosen.count("dmtp") >= 100 and chosen[-40:].count("dmtp") >= 38, chosen


def test_refreshes_go_to_the_least_measured_acceptance_before_the_stalest_time():
    """dmtp was judged on one row round that accepted nothing; mtp serves. The next refresh runs dmtp
    (1 measured row round) rather than ar or lookup (timed longer ago), and dmtp, found good, takes over."""
    policy = LoadPolicy({"ar": 1, "mtp": 5, "dmtp": 8, "lookup": 8}, refresh_every=8, refresh_share=1.0)
    for m in policy.slots:
        policy.observe(m, 1, rounds=1, seconds=0.02, row_rounds=0, committed=0)
    policy.observe("lookup", 1, rounds=1, seconds=0.02, row_rounds=40, committed=44)
    policy.observe("mtp", 1, rounds=1, seconds=0.02, row_rounds=40, committed=160)    # tau ~3.8
    policy.observe("dmtp", 1, rounds=1, seconds=0.02, row_rounds=1, committed=1)      # tau 3.7
    chosen = run(policy, lambda m, i: 0.02, {"ar": 1, "mtp": 4, "dmtp": 6, "lookup": 1.1}, choices=40)
    assert chosen[:7] == ["mtp"] * 7 and chosen[7] == "dmtp", chosen[:8]
    assert chosen[-24:].count("dmtp") >= 21, chosen
    assert policy.describe()["why"] in ("highest estimated tok/s", "refreshing mtp's estimate at 1 rows",
                                        "refreshing lookup's estimate at 1 rows")    # 41 row rounds: < 48


def test_each_method_is_estimated_at_the_dispatch_size_it_would_run():
    """The trace that cost auto a tenth of its tok/s at one client: mtp ran in 4-round dispatches
    (3.9 ms a round), dmtp's time came from 1-round dispatches (8.5 ms a round, 4.2 ms in 4-round
    ones). Compared at the dispatch each would run, dmtp's larger tau wins; with one round per
    dispatch (a request waits) the 1-round times decide."""
    policy = LoadPolicy({"ar": 1, "mtp": 5, "dmtp": 8}, {"mtp": 4.67, "dmtp": 5.4})
    for m, t1, t4 in (("ar", 0.0032, 0.0019), ("mtp", 0.0070, 0.0039), ("dmtp", 0.0085, 0.0042)):
        policy.observe(m, 1, rounds=1, seconds=t1, row_rounds=0, committed=0)
        policy.observe(m, 1, rounds=4, seconds=4 * t4, row_rounds=0, committed=0)
    assert policy.choose(1, 1, most=4) == "dmtp"
    assert policy.round_time("dmtp", 1, most=4) == 0.0042 and policy.rounds("dmtp", 1, 4) == 4
    assert policy.choose(1, 1, most=1) == "mtp"           # 4.67 / 7.0 ms beats 5.4 / 8.5 ms
    # a dispatch size never timed falls back to the 1-round time
    fresh = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0})
    fresh.observe("ar", 1, rounds=1, seconds=0.003, row_rounds=0, committed=0)
    fresh.observe("dmtp", 1, rounds=1, seconds=0.010, row_rounds=0, committed=0)
    assert fresh.round_time("dmtp", 1, most=4) == 0.010 and fresh.rounds("dmtp", 1, 4) == 4


def test_a_refresh_runs_one_round_and_the_best_runs_k():
    """At 8 rows ar wins (3.6 ms a round in 4-round dispatches); a refresh of lookup (13.8 ms a round)
    runs one round, not four: the refresh that cost a tenth of auto's tok/s at 8 clients."""
    policy = LoadPolicy({"ar": 1, "lookup": 8}, {"lookup": 2.4}, refresh_every=4, refresh_share=1.0)
    for m, t in (("ar", 0.0036), ("lookup", 0.0138)):
        policy.observe(m, 8, rounds=1, seconds=t, row_rounds=0, committed=0)
        policy.observe(m, 8, rounds=4, seconds=4 * t, row_rounds=0, committed=0)
    picks = []
    for _ in range(8):
        m = policy.choose(8, 8, most=4)
        picks.append((m, policy.describe()["rounds"]))
    assert picks.count(("ar", 4)) == 6 and picks[3] == ("lookup", 1) and picks[7] == ("lookup", 1), picks
    assert policy.choose(8, 8, most=1) == "ar" and policy.describe()["rounds"] == 1    # somebody waits
    # a K-round time above the 1-round one was taken in a slower spell: the estimate reads the 1-round
    # time (ar at 4.0 ms a round beats dmtp at 23 ms and tau 5, though its 4-round sample read 7.4)
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0}, refresh_every=1000)
    policy.observe("dmtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 5.0)    # trusted: not in step
    for m, t1, t4 in (("ar", 0.0040, 0.0074), ("dmtp", 0.025, 0.023)):
        policy.observe(m, 8, rounds=1, seconds=t1, row_rounds=0, committed=0)
        policy.observe(m, 8, rounds=4, seconds=4 * t4, row_rounds=0, committed=0)
    assert policy.round_time("ar", 8, most=4) == 0.0040 and policy.round_time("dmtp", 8, most=4) == 0.023
    assert policy.choose(8, 8, most=4) == "ar" and policy.describe()["rounds"] == 4
    # dmtp serves (23 ms a round); ar's 4-round time was a slow warm-up sample (7.4 ms a round, its
    # single rounds 8.0): its refresh runs the 4-round dispatch the estimate compares (cheaper than
    # dmtp's), so it is re-measured
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 5.0}, refresh_every=4, refresh_share=1.0)
    policy.observe("dmtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 5.0)    # trusted: not in step
    for m, t1, t4 in (("ar", 0.0080, 0.0074), ("dmtp", 0.025, 0.023)):
        policy.observe(m, 8, rounds=1, seconds=t1, row_rounds=0, committed=0)
        policy.observe(m, 8, rounds=4, seconds=4 * t4, row_rounds=0, committed=0)
    picks = []
    for _ in range(12):
        m = policy.choose(8, 8, most=4)
        k = policy.describe()["rounds"]
        picks.append((m, k))
        policy.observe(m, 8, rounds=k, seconds=k * (0.0043 if m == "ar" else 0.023), row_rounds=8 * k,
                       committed=8 * k * (1 if m == "ar" else 5.0))
    assert picks[:3] == [("dmtp", 4)] * 3 and picks[3] == picks[7] == ("ar", 4), picks
    assert picks[8:11] == [("ar", 4)] * 3, picks        # the outlier outvoted: 8 / 4.3 ms beats 8 x 5 / 23 ms
    assert picks[11] == ("dmtp", 1), picks              # dmtp's dispatch is the longer: its refresh is 1 round


def test_a_near_tie_keeps_the_method_serving():
    """ar serves; dmtp's estimate drifts 3 % above ar's: ar keeps serving (a switch would make the
    plain rounds' rows catch up); 10 % above: dmtp takes over, and a drift back within 5 % keeps it."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 4.0}, refresh_every=1000)
    policy.observe("ar", 8, rounds=1, seconds=0.005, row_rounds=0, committed=0)
    policy.observe("dmtp", 8, rounds=1, seconds=0.025, row_rounds=0, committed=0)     # 4 / 25 ms < 1 / 5 ms
    assert policy.choose(8, 8) == "ar"
    policy.observe("dmtp", 8, rounds=1, seconds=0.025, row_rounds=200, committed=200 * 5.15)
    assert policy.tau["dmtp"] > 5.1 and policy.choose(8, 8) == "ar"          # 1.03x ar's estimate
    policy.observe("dmtp", 8, rounds=1, seconds=0.025, row_rounds=400, committed=400 * 5.5)
    assert policy.choose(8, 8) == "dmtp"                                      # 1.1x
    policy.observe("dmtp", 8, rounds=1, seconds=0.025, row_rounds=400, committed=400 * 4.9)
    assert policy.choose(8, 8) == "dmtp"                                      # 0.98x: dmtp stays


def test_a_tokens_share_of_its_prefill_counts_where_rounds_are_cheap():
    """At 32 rows mtp's round (25 ms for 3.3 tokens a row) beats ar's (8.5 ms) by 10 %, but ar's rows,
    begun together, end together and are prefilled 32 to a lean call (160 ms), while mtp's end one by
    one, each prefilled in a full call of its own (12 ms): over 64 tokens a request, ar wins by 40 %.
    Once ar's calls are seen to hold one request each, only the lean call's saving is left. On one
    row the prefills do not matter: dmtp's 5 tokens for 2x ar's round win."""
    policy = LoadPolicy({"ar": 1, "mtp": 5, "dmtp": 8}, {"mtp": 3.3, "dmtp": 5.0})
    for m, t32, t1 in (("ar", 0.0085, 0.003), ("mtp", 0.025, 0.005), ("dmtp", 0.08, 0.006)):
        policy.observe(m, 32, rounds=1, seconds=t32, row_rounds=0, committed=0)
        policy.observe(m, 1, rounds=1, seconds=t1, row_rounds=0, committed=0)
    assert policy.choose(32, 32) == "mtp" and policy.admission_s("mtp", 32) == 0.0    # nothing timed yet
    for lean, rows, seconds in ((False, 1, 0.012), (True, 1, 0.010), (False, 32, 0.20), (True, 32, 0.16)):
        policy.time_prefill(lean, rows, seconds)
    assert policy.choose(32, 32) == "mtp"           # no request finished yet: tokens per request unknown
    policy.observe_output(64)
    assert policy.admission_s("ar", 32) == 0.16 / 32 / 64 and policy.admission_s("mtp", 32) == 0.012 / 64
    est = policy.estimates(32, 32)
    assert policy.choose(32, 32) == "ar" and est["ar"] > 1.05 * est["mtp"], est
    policy.observe_prefill(True, 32, 32, 0.32, 32)  # live calls take twice the table's: every prefill does
    assert policy.admission_s("ar", 32) == 2 * 0.16 / 32 / 64 and policy.admission_s("mtp", 32) == 2 * 0.012 / 64
    est = policy.estimates(32, 32)
    assert est["ar"] > 1.4 * est["mtp"], est
    for _ in range(40):                             # ar's rows came apart: one request a call
        policy.observe_prefill(True, 1, 1, 0.020, 32)
    assert 0.9 * 2 * 0.010 / 64 < policy.admission_s("ar", 32) < 2 * 0.010 / 64
    est = policy.estimates(32, 32)
    assert est["ar"] < 1.1 * est["mtp"], est        # a near tie: only the lean call's saving is left
    assert policy.choose(1, 1) == "dmtp"
    plain = LoadPolicy({"ar": 1}, {})               # a bank without lean prefills: every method pays the full one
    plain.time_prefill(False, 1, 0.024)
    plain.observe_output(64)
    assert plain.admission_s("ar", 1) == 0.024 / 64


def test_speculative_timing_and_refreshes_run_in_step_while_plain_rounds_serve():
    """Before any method serves and while ar serves, a timing or refresh dispatch of mtp or dmtp is one
    round in step (one token per row: rows admitted together still finish together); a dispatch of
    the method serving, ar's refresh, and a refresh while a speculative method serves are not."""
    policy = LoadPolicy(SLOTS, {"mtp": 2.0, "dmtp": 3.0}, refresh_every=4, refresh_share=10.0)   # any refresh
    runs = []
    for i in range(64):
        m = policy.choose(32, 32, most=4)
        d = policy.describe()
        runs.append((m, d["refresh"] or d["why"].startswith("timing"), d["in_step"], d["rounds"]))
        cheap = i >= 20 and m == "dmtp"         # from choice 20 dmtp's rounds get cheap: it takes over at 40
        policy.observe(m, 32, rounds=d["rounds"], seconds=d["rounds"] * (0.003 if cheap or m == "ar" else 0.05),
                       row_rounds=32 * d["rounds"], committed=32 * d["rounds"] * SLOTS[m] / 2)
    serving = [r for r in runs if not r[1]]
    assert serving and all(not in_step for _, _, in_step, _ in serving)
    probes = [(m, in_step, k) for m, probe, in_step, k in runs[:20] if probe]
    assert ("ar", False, 1) in probes and ("mtp", True, 1) in probes and ("dmtp", True, 1) in probes, probes
    assert all(in_step == (m != "ar") and k == 1 for m, in_step, k in probes), probes
    late = [(m, in_step) for m, probe, in_step, _ in runs[44:] if probe]
    assert {m for m, probe, *_ in runs[44:] if not probe} == {"dmtp"}, runs
    assert {m for m, _ in late} == {"ar", "mtp"} and not any(in_step for _, in_step in late), late


def test_a_speculative_method_chosen_on_its_prior_runs_in_step_until_measured():
    """dmtp's prior (6 tokens a row for 2x ar's round) wins at 8 rows: its dispatches run one round in
    step until 48 row rounds measure it, then K rounds; on one row nothing runs in step."""
    policy = LoadPolicy({"ar": 1, "dmtp": 8}, {"dmtp": 6.0}, refresh_every=1000)
    for bucket in (1, 8):
        policy.observe("ar", bucket, rounds=1, seconds=0.01, row_rounds=0, committed=0)
        policy.observe("dmtp", bucket, rounds=1, seconds=0.02, row_rounds=0, committed=0)
    assert policy.choose(8, 8, most=4) == "dmtp"
    assert policy.describe()["in_step"] and policy.describe()["rounds"] == 1
    assert policy.choose(1, 1, most=4) == "dmtp"
    assert not policy.describe()["in_step"] and policy.describe()["rounds"] == 4
    policy.observe("dmtp", 8, rounds=1, seconds=0.02, row_rounds=48, committed=48 * 6)
    assert policy.choose(8, 8, most=4) == "dmtp"
    assert not policy.describe()["in_step"] and policy.describe()["rounds"] == 4


def test_a_method_replaces_the_serving_one_only_on_a_fresh_time():
    """At 8 rows ar serves (2.5 ms a round when timed with mtp, 10 ms); its live rounds then take 4 ms
    (its rows grew longer): mtp's old time would win. Its time is re-taken first (a confirming
    dispatch, in step beside plain rounds): at 16 ms (longer rows cost it too) ar keeps serving; at
    10 ms (only ar slowed) mtp replaces it. Before, mtp replaced ar on its old time at once."""
    from dmtp_jax.serve.policy import CONFIRM_AGE
    for confirmed_s, after in ((0.016, "ar"), (0.010, "mtp")):
        policy = LoadPolicy({"ar": 1, "mtp": 5}, {"mtp": 3.0}, refresh_every=10_000)
        policy.observe("mtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 3)     # trusted
        for method, seconds in (("ar", 0.0025), ("mtp", 0.010)):
            policy.observe(method, 8, rounds=1, seconds=seconds, row_rounds=0, committed=0)
        for i in range(CONFIRM_AGE + 3):       # 4 ms from the CONFIRM_AGE-th: the median has it from then on
            assert policy.choose(8, 8) == "ar" and policy.describe()["served"]
            policy.observe("ar", 8, rounds=1, seconds=0.004 if i >= CONFIRM_AGE else 0.0025, row_rounds=8, committed=8)
        assert policy.choose(8, 8) == "mtp"
        choice = policy.describe()
        assert choice["why"] == "confirming mtp's estimate before it replaces ar", choice["why"]
        assert choice["in_step"] and not choice["served"] and choice["rounds"] == 1
        policy.observe("mtp", 8, rounds=1, seconds=confirmed_s, row_rounds=8, committed=8 * 3)
        assert policy.round_time("mtp", 8) == confirmed_s          # the fresh time, not a median with the old
        assert policy.choose(8, 8) == after and policy.describe()["served"]


def test_the_method_replaced_is_re_taken_once_after_the_switch():
    """At 8 rows ar serves at 2.5 ms a round until a slow spell takes its live rounds to 5 ms; mtp's
    confirmed time (10 ms, 3 tokens a round) then wins and mtp serves. `CONFIRM_AGE` choices later
    ar's time is re-taken once: at 2.5 ms (the spell is over) it supersedes the slow-spell samples and ar
    serves again; at 8 ms it joins them (their median stays 5 ms) and mtp keeps serving. Before, ar's
    slow median stood and mtp kept serving."""
    from dmtp_jax.serve.policy import CONFIRM_AGE
    for retaken_s, after, median_s in ((0.0025, "ar", 0.0025), (0.008, "mtp", 0.005)):
        policy = LoadPolicy({"ar": 1, "mtp": 5}, {"mtp": 3.0}, refresh_every=10_000)
        policy.observe("mtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 3)     # trusted
        for method, seconds in (("ar", 0.0025), ("mtp", 0.010)):
            policy.observe(method, 8, rounds=1, seconds=seconds, row_rounds=0, committed=0)
        for i in range(CONFIRM_AGE + 3):       # the slow spell from the CONFIRM_AGE-th round
            assert policy.choose(8, 8) == "ar"
            policy.observe("ar", 8, rounds=1, seconds=0.005 if i >= CONFIRM_AGE else 0.0025, row_rounds=8, committed=8)
        assert policy.choose(8, 8) == "mtp" and policy.describe()["confirm"]
        policy.observe("mtp", 8, rounds=1, seconds=0.010, row_rounds=8, committed=8 * 3)
        for _ in range(CONFIRM_AGE):
            assert policy.choose(8, 8) == "mtp" and policy.describe()["served"]
            policy.observe("mtp", 8, rounds=1, seconds=0.010, row_rounds=8, committed=8 * 3)
        assert policy.choose(8, 8) == "ar"
        choice = policy.describe()
        assert choice["why"] == "re-taking ar's time at 8 rows after mtp replaced it", choice["why"]
        assert choice["refresh"] and choice["retake"] and not choice["served"]
        policy.observe("ar", 8, rounds=1, seconds=retaken_s, row_rounds=8, committed=8)
        assert policy.round_time("ar", 8) == median_s
        assert policy.choose(8, 8) == after and policy.describe()["served"]
        policy.observe(after, 8, rounds=1, seconds=0.010 if after == "mtp" else retaken_s, row_rounds=8,
                       committed=8 * (3 if after == "mtp" else 1))
        retakes = 0
        for _ in range(3 * CONFIRM_AGE):      # once per switch: only mtp, replaced by ar, is re-taken once more
            method = policy.choose(8, 8)
            retakes += policy.describe()["retake"]
            policy.observe(method, 8, rounds=1, seconds=0.010 if method == "mtp" else retaken_s, row_rounds=8,
                           committed=8 * (3 if method == "mtp" else 1))
            assert policy.describe()["retake"] or method == after
        assert retakes == (after == "ar")


def test_a_refresh_moves_the_other_dispatch_sizes_of_a_method_not_serving():
    """ar serves 4-round dispatches at 8 rows; mtp's 4-round time is warm-up's (8 ms a round). Its
    refreshes run one round in step and take 16 ms (against 10 at warm-up): its 4-round time moves
    with them, so when ar's live rounds then slow from 2 to 3 ms, ar keeps serving. Before, a refresh
    left the 4-round time at 8 ms and made mtp fresh, so mtp replaced ar on that stale time."""
    policy = LoadPolicy({"ar": 1, "mtp": 5}, {"mtp": 3.0}, refresh_every=4, refresh_share=1.0)
    policy.observe("mtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 3)     # trusted
    for method, one, four in (("ar", 0.0025, 0.002), ("mtp", 0.010, 0.008)):         # warm-up's times
        policy.observe(method, 8, rounds=1, seconds=one, row_rounds=0, committed=0)
        policy.observe(method, 8, rounds=4, seconds=4 * four, row_rounds=0, committed=0)
    refreshes = 0
    for _ in range(16):
        method, choice = policy.choose(8, 8, most=4), policy.describe()
        if method == "mtp":
            assert choice["refresh"] and not choice["served"] and choice["rounds"] == 1, choice
            refreshes += 1
            policy.observe("mtp", 8, rounds=1, seconds=0.016, row_rounds=8, committed=8 * 3)
        else:
            assert method == "ar" and choice["served"] and choice["rounds"] == 4, choice
            policy.observe("ar", 8, rounds=4, seconds=4 * (0.003 if refreshes else 0.002), row_rounds=32,
                           committed=32)
    assert refreshes >= 2
    assert abs(policy.round_time("mtp", 8, most=4) - 0.008 * 16 / 10) < 1e-12


def test_warm_up_times_rounds_on_scratch_states_ready_before_the_clock():
    """`time_rounds` waits for each scratch state (built asynchronously: zero-filling every cache of
    its rows) before the dispatch it times, so the state's making is not in a round's time (it was:
    ar's round at 32 rows of the demo's auto bank timed 20-25 ms against 7-9 live), and seeds each
    (method, bucket, dispatch size) with the fastest of its runs."""
    from types import SimpleNamespace

    import jax

    from dmtp_jax.serve.warmup import TIMED_RUNS, time_rounds

    class Scratch:
        ready = False

        def block_until_ready(self):
            self.ready = True
            return self

    runs = []

    def run(method, state, active, limits, sp, key, first_round, greedy, k, buffer=None):
        assert state.ready, "a scratch state timed before it was ready"
        runs.append((method, k))
        run_index = (runs.count((method, k)) - 1) % TIMED_RUNS
        seconds = k * 0.001 * (2 if method == "mtp" else 1) * (TIMED_RUNS - run_index)     # the last run fastest
        return state, None, None, None, k, seconds, 0.0

    bank = SimpleNamespace(methods=["ar", "mtp"], new_state=lambda rows, max_len: Scratch(), run=run)
    policy = LoadPolicy({"ar": 1, "mtp": 5})
    engine = SimpleNamespace(bank=bank, policy=policy, buckets=(1, 4), rounds_per_dispatch=4, max_top_k=0,
                             max_model_len=64, max_len=64, base_key=jax.random.key(0))
    time_rounds(engine)
    assert len(runs) == TIMED_RUNS * 2 * 2 * 2       # runs x methods x dispatch sizes x buckets
    assert policy.round_s == {(m, b, k): 0.001 * (2 if m == "mtp" else 1)
                              for m in ("ar", "mtp") for b in (1, 4) for k in (1, 4)}


def test_warm_up_times_prefills_in_runs_over_every_shape(monkeypatch):
    """`time_prefills` times each prefill shape's calls in runs that go over every shape in turn and
    keeps each one's fastest, so a slow spell over three consecutive calls slows one run of three
    shapes, not all of one shape's (they ran back to back, the median kept: the demo's auto engine
    once read its lean 8-row 64-wide call at 74.7 ms against 59.9 for the full one, and so
    prefilled a wave of six short and two long prompts one request at a time: 29 groups for 64
    requests instead of 20). The 64-wide times are the policy's table."""
    from types import SimpleNamespace

    from dmtp_jax.serve import warmup
    from dmtp_jax.serve.stats import RecentMedians

    base = {(1, 64, False): 0.012, (8, 64, False): 0.060, (8, 64, True): 0.050, (8, 128, True): 0.100}
    calls = []

    def run_prefill(engine, reqs, rows, cache=None, lean=False):
        key = (rows, reqs[0], lean)
        calls.append(key)
        return base[key] * (3 if 1 <= len(calls) - 1 <= 3 else 1)     # a spell over the 2nd to 4th calls

    monkeypatch.setattr(warmup, "run_prefill", run_prefill)
    policy = LoadPolicy({"ar": 1, "mtp": 5})
    engine = SimpleNamespace(prefill_times=RecentMedians(), warm_prefills=set(), policy=policy)
    warmup.time_prefills(engine, {key: [key[1]] for key in base}, table_width=64)
    assert len(calls) == warmup.TIMED_RUNS * len(base) and calls[:len(base)] == list(base)
    assert engine.prefill_times.as_dict() == base and engine.warm_prefills == set(base)
    assert policy.prefill._table == {(False, 1): 0.012, (False, 8): 0.060, (True, 8): 0.050}


def test_tau_averages_over_requests_lives_not_over_the_last_dispatch():
    """8 rows served by mtp in 4-round dispatches, the requests admitted together: each wave keeps 4.3
    tokens a row round mid-life and fewer in its last dispatches (a round's tokens past max_tokens are
    not kept). tau stays within 5 % of the waves' mean whichever dispatch came last, so a method's
    estimate does not swing with where the running requests are in their lives (with a window of 20 row
    rounds it was the last dispatch's, 15 % under the mean after a wave's end)."""
    policy = LoadPolicy({"ar": 1, "mtp": 4}, {"mtp": 3.0})
    life = [(4, 32, 4.0), (4, 32, 4.3), (4, 32, 4.3), (4, 26, 3.5), (2, 5, 2.6)]    # rounds, row rounds, kept
    mean = sum(rr * kept for _, rr, kept in life) / sum(rr for _, rr, _ in life)
    seen = []
    for wave in range(30):
        for rounds, row_rounds, kept in life:
            policy.observe("mtp", 8, rounds=rounds, seconds=0.04, row_rounds=row_rounds, committed=row_rounds * kept)
            seen += [policy.tau["mtp"]] if wave >= 10 else []
    assert max(abs(t / mean - 1) for t in seen) < 0.05, (min(seen), max(seen), mean)


def test_a_refresh_waits_for_a_choice_while_nobody_waits():
    """mtp serves at 8 rows and arrivals often wait (one-round dispatches then). ar's refresh, once due,
    waits for a choice while nobody waits and runs the 4-round dispatch its estimate uses, so that time
    is re-measured rather than moved with a one-round one (whose host round trip weighs more under a
    server's load)."""
    policy = LoadPolicy({"ar": 1, "mtp": 4}, {"mtp": 4.0}, refresh_every=4, refresh_share=1.0)
    policy.observe("mtp", 8, rounds=0, seconds=0.0, row_rounds=48, committed=48 * 4.0)     # trusted
    for m, t in (("ar", 0.004), ("mtp", 0.012)):          # ar 2000 tok/s at 8 rows, mtp 2667
        policy.observe(m, 8, rounds=1, seconds=1.5 * t, row_rounds=0, committed=0)
        policy.observe(m, 8, rounds=4, seconds=4 * t, row_rounds=0, committed=0)
    picks = []
    for i in range(1, 13):
        idle = i % 3 == 0                                   # nobody waits at choices 3, 6, 9, 12
        m = policy.choose(8, 8, most=4, idle=idle)
        k = policy.describe()["rounds"]
        picks.append((i, m, k))
        t = 0.004 if m == "ar" else 0.012
        policy.observe(m, 8, rounds=k, seconds=k * t, row_rounds=8 * k, committed=8 * k * (1 if m == "ar" else 4))
    refreshes = [p for p in picks if p[1] == "ar"]
    assert refreshes and all(k == 4 and i % 3 == 0 for i, _, k in refreshes), picks
