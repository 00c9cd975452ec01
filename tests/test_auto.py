"""`--method auto`: greedy output equal to `ar` whatever is chosen, the verdict kept per batch bucket
(in memory and in its JSON file, without prompt text or token ids), sampled output lossless, the
server measuring on its first requests, and the bench / generate commands."""

import json

import pytest

from dflash_fixtures import saved_dmtp_drafter
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.auto import AutoDecoder, VerdictStore
from dmtp_jax.decode.sampling import SamplingParams

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94]]


@pytest.fixture(scope="module")
def dmtp_dir(mtp_target_dir, tmp_path_factory):
    cfg = load_target(mtp_target_dir).cfg
    return saved_dmtp_drafter(str(tmp_path_factory.mktemp("auto") / "dmtp"), cfg, "dmtp", fusion_seed=1)


@pytest.fixture(scope="module")
def decoders(mtp_target_dir, dmtp_dir):
    """ar, mtp and dmtp on the MTP target: one set of decoders (and compiles) for the file."""
    target = load_target(mtp_target_dir)
    mtp = load_mtp(mtp_target_dir, target.cfg)
    drafter, fusion = load_dmtp_drafter(dmtp_dir, target.cfg)
    return {"ar": ARDecoder(target), "mtp": make_decoder("mtp", target, mtp=mtp, mtp_steps=3),
            "dmtp": make_decoder("dmtp", target, drafter, mtp=mtp, fusion=fusion)}


class Counting:
    """A decoder that counts its generate calls."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return self.decoder.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def test_greedy_auto_equals_ar_and_keeps_its_verdict_per_bucket(decoders, tmp_path):
    reversed_prompts = [p[::-1] for p in PROMPTS]
    want = decoders["ar"].generate(PROMPTS, 20, stop_ids=[]).output_ids
    want_reversed = decoders["ar"].generate(reversed_prompts, 20, stop_ids=[]).output_ids
    path = str(tmp_path / "verdicts.json")
    auto = AutoDecoder(decoders, store=VerdictStore(path), probe_tokens=8, repeats=1)
    # 3 rows are fewer than MIN_PROBE_ROWS: provisional, nothing stored; the next request completes it
    res = auto.generate(PROMPTS, 20, stop_ids=[])
    assert res.output_ids == want and res.stats["auto"]["source"] == "provisional"
    assert auto.generate(PROMPTS, 20, stop_ids=[]).stats["auto"]["measure_s"] == 0.0     # same prompts: no probe
    res = auto.generate(reversed_prompts, 20, stop_ids=[])
    assert res.output_ids == want_reversed
    verdict = res.stats["auto"]
    assert verdict["source"] == "measured" and verdict["batch_bucket"] == 4
    assert set(verdict["measured"]) == {"ar", "mtp", "dmtp"}
    assert all(m["decode_tokens_per_s"] > 0 and m["probe_tokens"] == 8 and m["probe_requests"] == 2
               for m in verdict["measured"].values())
    assert verdict["measured"]["dmtp"]["tau_per_verify"] > 1.0 and verdict["measured"]["ar"]["tau_per_verify"] == 1.0
    chosen = verdict["method"]
    assert chosen == max(verdict["measured"], key=lambda m: verdict["measured"][m]["decode_tokens_per_s"])
    assert res.stats["method"] == f"auto:{chosen}"

    # the file: one verdict, nothing of the prompts
    stored = json.load(open(path))
    assert len(stored) == 1
    record = next(iter(stored.values()))
    assert record["method"] == chosen and record["batch_bucket"] == 4 and record["greedy"] is True
    assert set(record) == {"method", "measured", "batch_bucket", "greedy", "target", "device", "dtype", "when"}

    def lists(x):
        inside = x.values() if isinstance(x, dict) else []
        return [x] if isinstance(x, list) else [y for v in inside for y in lists(v)]
    assert lists(stored) == []                  # no token ids anywhere

    # a new decoder over the same models reads the verdict: only the chosen method runs
    counted = {m: Counting(d) for m, d in decoders.items()}
    again = AutoDecoder(counted, store=VerdictStore(path), probe_tokens=8, repeats=1)
    res = again.generate(PROMPTS, 20, stop_ids=[])
    assert res.stats["auto"]["source"] == "cache" and res.stats["auto"]["method"] == chosen
    assert {m: c.calls for m, c in counted.items()} == {m: int(m == chosen) for m in counted}
    assert res.output_ids == want
    # another batch bucket is measured again (batch 1: over four requests), and kept next to the first
    sources = []
    for i, prompt in enumerate(PROMPTS + [[42, 17]]):
        res = again.generate([prompt], 20, stop_ids=[])
        sources.append(res.stats["auto"]["source"])
        assert res.output_ids == decoders["ar"].generate([prompt], 20, stop_ids=[]).output_ids
    assert sources == ["provisional"] * 3 + ["measured"] and res.stats["auto"]["batch_bucket"] == 1
    assert len(json.load(open(path))) == 2


def test_sampled_auto_is_lossless(decoders, mtp_target_dir):
    auto = AutoDecoder({m: decoders[m] for m in ("mtp", "dmtp")}, store=VerdictStore(None), probe_tokens=3,
                       repeats=1)
    assert_matches_target_joint(auto, decoders["ar"].target, PROMPTS[0], SamplingParams.make(temperature=1.0,
                                                                                                 top_k=3))


def test_server_engine_follows_the_load_on_one_state(decoders):
    """`serve --method auto`: one state for ar, dmtp and (an extra method) mtp rounds (its candidate's 4
    slots), each timed live at the batch's bucket; outputs equal ar's; /metrics shows the choice."""
    from dmtp_jax.serve.engine import Engine, Request
    from dmtp_jax.serve.metrics import ServerMetrics

    engine = Engine(AutoDecoder(decoders, store=VerdictStore(None)), max_batch_size=2, max_model_len=128,
                    buckets=(2,), extra_methods=("mtp",))
    assert engine.method == "auto" and engine.bank.slots == {"ar": 1, "dmtp": decoders["dmtp"].slots, "mtp": 4}
    reqs = [engine.add(Request(p, max_tokens=12, stop_ids=())) for p in PROMPTS]
    while not all(r.finished for r in reqs):
        engine.step()
    want = decoders["ar"].generate(PROMPTS, 12, stop_ids=[]).output_ids
    assert [r.output_ids for r in reqs] == want
    assert {m for m, *_ in engine.policy.round_s} == set(engine.bank.methods)
    assert f'dmtp_engine_choice{{method="{engine.choice["method"]}"' in ServerMetrics().render(engine)


def test_bench_and_generate_run_auto(mtp_target_dir, dmtp_dir, tmp_path, capsys):
    import infer
    out, outputs = tmp_path / "bench.json", tmp_path / "outputs.jsonl"
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS + [[42, 17]]))
    assert infer.main(["bench", "--target", mtp_target_dir, "--draft", dmtp_dir, "--methods", "ar,auto",
                       "--workload", str(workload), "--max-new-tokens", "12", "--no-phases", "--json", str(out),
                       "--outputs", str(outputs)]) == 0
    rows = [json.loads(line) for line in open(outputs)]
    by_method = {m: [r["output_ids"] for r in rows if r["method"] == m] for m in ("ar", "auto")}
    assert by_method["auto"] == by_method["ar"] and len(by_method["ar"]) == 4
    verdict = json.load(open(out))["methods"]["auto"]["auto"]["1"]
    assert set(verdict["measured"]) == {"ar", "lookup", "mtp", "dmtp"}     # what the models allow
    assert "auto, batch bucket 1: " + verdict["method"] in capsys.readouterr().out
    # generate finds the bench's verdict in $DMTP_JAX_CACHE
    assert infer.main(["generate", "--target", mtp_target_dir, "--draft", dmtp_dir, "--method", "auto",
                       "--prompt-ids", "5,9,31", "--max-new-tokens", "8"]) == 0
    assert f"auto, batch bucket 1: {verdict['method']} (cached verdict" in capsys.readouterr().err


def test_bench_report_of_auto_with_different_methods_per_bucket(decoders):
    """Buckets decided differently (mtp: 4 slots; dmtp: 8): the run's rows are pooled with the
    widest block, and each bucket's verdict is in the report."""
    from dmtp_jax.bench.report import build_report, format_auto
    from dmtp_jax.bench.runner import run_benchmark
    from dmtp_jax.bench.workloads import Request, Workload

    auto = AutoDecoder(decoders, store=VerdictStore(None))
    auto.store.put(auto.key(2, True), {"method": "mtp", "measured": {}})
    auto.store.put(auto.key(1, True), {"method": "dmtp", "measured": {}})
    workload = Workload("ids", "test", tuple(Request(str(i), prompt_ids=tuple(p)) for i, p in enumerate(PROMPTS)))
    runs = run_benchmark({"ar": decoders["ar"], "auto": auto}, workload, None, max_new_tokens=12, batch_size=2)
    assert [g.output_ids for g in runs["auto"].generations] == [g.output_ids for g in runs["ar"].generations]
    report = build_report(runs, {})
    assert report["methods"]["auto"]["block_size"] == 8
    assert {b: v["method"] for b, v in report["methods"]["auto"]["auto"].items()} == {"1": "dmtp", "2": "mtp"}
    assert "auto, batch bucket 2: mtp (cached verdict)" in format_auto(report)


def test_auto_report_stats_pool_every_generation_it_served():
    """A cold verdict cache may serve another candidate first (provisional verdicts): the auto row's
    acceptance statistics pool the rounds of every generation, whichever method served it (the
    generations its tokens/s counts), and the row says which methods served how many."""
    from dmtp_jax.bench.report import format_auto, summarize_run
    from dmtp_jax.bench.runner import Generation, MethodRun
    run = MethodRun("auto", [Generation("a", 0, [1], [5] * 9, [4, 4], None, "mtp"),
                             Generation("b", 0, [1], [5] * 8, [1, 1, 1, 1, 1, 1, 1], None, "dmtp")],
                    block_size=8, new_tokens=17, wall_s=1.0)
    s = summarize_run(run)
    assert s["histogram"] == [7, 0, 0, 2, 0, 0, 0, 0] and s["block_size"] == 8 and s["rounds"] == 9
    assert s["per_verify_acceptance_length"] == pytest.approx(15 / 9)
    assert s["first_candidate_acceptance"] == pytest.approx(2 / 9)
    assert s["target_forwards_per_token"] == pytest.approx((2 + 9) / 17)
    assert s["served"] == {"mtp": 1, "dmtp": 1}
    assert "its acceptance statistics pool the rounds of all of them" in format_auto({"methods": {"auto": s}})
