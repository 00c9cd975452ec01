"""`infer.py bench` and `dmtp_jax.bench`: JSON / PNG report, greedy speculative outputs equal to `ar`
over a workload, multi-turn prompts carrying the model's own answers, and one-line errors."""

import json
import os

import pytest

import infer
from dmtp_jax.bench.report import build_report, format_table
from dmtp_jax.bench.runner import run_benchmark
from dmtp_jax.commands.models import DEMO_DIR, method_models, uses_demo
from dmtp_jax.decode.loading import load_method_models, make_decoders
from dmtp_jax.options import ModelSources
from dmtp_jax.bench.workloads import (WORKLOADS, Request, default_data_dir, load_workload,
                                      render_prompt)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ID_PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60], [42, 17]]
METHOD_KEYS = {"per_request_acceptance_length", "per_verify_acceptance_length", "first_candidate_acceptance",
               "conditional_acceptance", "cumulative_acceptance", "tokens_per_second", "speedup_vs_ar"}
DATA_DIR = default_data_dir()
needs_data = pytest.mark.skipif(not os.path.isdir(DATA_DIR),
                                reason=f"shared data directory {DATA_DIR} is absent (set DMTP_JAX_DATA)")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from dflash_fixtures import build_reference_drafter
    d = str(tmp_path_factory.mktemp("bench") / "draft")
    build_reference_drafter(d, seed=1)
    return d


@pytest.fixture(scope="module")
def ids_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "ids.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in ID_PROMPTS) + "\n\n")
    return str(path)


def test_bench_cli_json_and_plot(tiny_qwen3_dir, draft_dir, ids_jsonl, tmp_path, capsys):
    out, png, gens = tmp_path / "bench.json", tmp_path / "acc.png", tmp_path / "outputs.jsonl"
    rc = infer.main(["bench", "--target", tiny_qwen3_dir, "--draft", draft_dir, "--methods", "ar,dflash",
                     "--workload", ids_jsonl, "--batch-size", "2", "--max-new-tokens", "12",
                     "--json", str(out), "--plot", str(png), "--outputs", str(gens)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "tau/ver" in table and "T7" in table and "dflash" in table
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"ar", "dflash"}
    for m in data["methods"].values():
        assert METHOD_KEYS <= set(m)
    d, a = data["methods"]["dflash"], data["methods"]["ar"]
    assert len(d["conditional_acceptance"]) == 7 and len(d["cumulative_acceptance"]) == 7
    assert 1.0 <= d["per_verify_acceptance_length"] <= 8.0 and d["speedup_vs_ar"] > 0
    assert a["conditional_acceptance"] == [] and a["cumulative_acceptance"] == []
    assert a["per_request_acceptance_length"] == a["per_verify_acceptance_length"] == 1.0
    assert a["speedup_vs_ar"] == 1.0
    assert data["config"]["workload"] == "ids.jsonl" and data["config"]["requests"] == len(ID_PROMPTS)
    assert d["generations"] == a["generations"] == len(ID_PROMPTS)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "phases (greedy round" in table and set(data["phases"]) == {"dflash"}     # spec methods only
    assert data["phases"]["dflash"]["round_ms"] > 0 and data["phases"]["dflash"]["phases_ms"]["verify"] > 0

    records = [json.loads(line) for line in gens.read_text().splitlines()]
    by_method = {m: [r for r in records if r["method"] == m] for m in ("ar", "dflash")}
    assert [r["prompt_ids"] for r in by_method["ar"]] == ID_PROMPTS
    assert [r["output_ids"] for r in by_method["dflash"]] == [r["output_ids"] for r in by_method["ar"]]
    for r in by_method["dflash"]:      # greedy speculative == greedy plain, token for token
        assert sum(r["acceptance_lengths"]) >= len(r["output_ids"]) - 1


def test_runner_keeps_outputs_and_skips_too_long(tiny_qwen3_dir, draft_dir, ids_jsonl):
    from dmtp_jax.checkpoint.hf import load_target
    target = load_target(tiny_qwen3_dir)
    models = load_method_models(ModelSources(draft=draft_dir), target, ["ar", "dflash"])
    assert models["ar"] == {} and set(models["dflash"]) == {"drafter"}
    wl = load_workload(ids_jsonl)
    decoders = make_decoders(["ar"], target, models)
    runs = run_benchmark(decoders, wl, None, max_new_tokens=12, batch_size=4, stop_ids=[127],
                         max_positions=20)     # prompt "2" (11 ids) + 12 > 20: skipped
    ar = runs["ar"]
    assert ar.skipped == [("2", 0)] and not ar.speculative
    assert [g.prompt_ids for g in ar.generations] == [p for i, p in enumerate(ID_PROMPTS) if i != 2]
    want = decoders["ar"].generate([p for i, p in enumerate(ID_PROMPTS) if i != 2], 12, stop_ids=[127])
    assert [g.output_ids for g in ar.generations] == want.output_ids
    assert ar.new_tokens == sum(map(len, want.output_ids)) and ar.retimed_calls == 0
    assert "ar" in format_table(build_report(runs, {}))


def share_key(kind: str):
    """A fake `MODEL_LOADERS` entry's sharing rule: one fusion per method, one of the others for all."""
    return (lambda m: m) if kind == "fusion" else (lambda m: None)


def test_method_models_follow_method_needs(monkeypatch):
    from dmtp_jax import decode
    from dmtp_jax.decode import loading
    calls = []
    fake = {kind: ((lambda k: lambda a, t, m: calls.append((k, m)) or f"{k}:{m}")(kind), share_key(kind))
            for kind in ("drafter", "mtp", "fusion")}
    monkeypatch.setattr(loading, "MODEL_LOADERS", fake)
    methods = ["ar", "mtp", "dflash", "dmtp", "dmtp-single"]
    models = load_method_models(ModelSources(), None, methods)
    assert models["ar"] == {}
    for m in methods[1:]:
        assert set(models[m]) == {k for k, v in decode.method_needs(m).items() if v}
    assert sorted(k for k, _ in calls if k != "fusion") == sorted({k for m in methods[1:] for k, v in
                                                                    decode.method_needs(m).items()
                                                                    if v and k != "fusion"})


@pytest.mark.parametrize("records,extra,message", [
    (None, ["--workload", "nope"], "unknown workload 'nope'"),
    ([{"prompt": "hello"}], [], "has no tokenizer"),
    ([{"turns": ["a", "b"]}], [], "has no tokenizer"),
    ([{"foo": 1}], [], "exactly one of"),
    ([{"prompt_ids": [1, "x"]}], [], "'prompt_ids' must be"),
    ("{not json", [], "not valid JSON"),
    ([{"prompt_ids": [1]}], ["--methods", "ar,warp"], "unknown method"),
    ([{"prompt_ids": [1]}], ["--methods", "dflash"], "drafter"),
    ([{"prompt_ids": [1]}], ["--num-prompts", "0"], "--num-prompts must be >= 1"),
])
def test_bad_input_is_one_line(tiny_qwen3_dir, tmp_path, capsys, records, extra, message):
    path = tmp_path / "w.jsonl"
    path.write_text(records if isinstance(records, str) else "\n".join(json.dumps(r) for r in records or []))
    rc = infer.main(["bench", "--target", tiny_qwen3_dir, "--workload", str(path), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_data_dir_is_one_line(tiny_qwen3_dir, tmp_path, capsys):
    rc = infer.main(["bench", "--target", tiny_qwen3_dir, "--workload", "gsm8k", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "gsm8k/test.jsonl" in err and "does not exist" in err


def test_chat_template_prompts_carry_answers_and_tools():
    from dmtp_jax.tiny import save_byte_tokenizer
    from transformers import AutoTokenizer
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        save_byte_tokenizer(d)
        tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = ("{% for m in messages %}<{{m.role}}>{{m.content}}\n{% endfor %}"
                         "{% if tools %}TOOLS{{tools|tojson}}{% endif %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    req = Request("q", turns=("first?", "second?"), tools=({"name": "f"},))
    text = tok.decode(render_prompt(req, tok, ["my answer"]))
    assert text == '<user>first?\n<assistant>my answer\n<user>second?\nTOOLS[{"name": "f"}]<assistant>'
    tok.chat_template = None
    assert tok.decode(render_prompt(req, tok, [])).endswith('{"name": "f"}\n\nfirst?')


@needs_data
def test_every_named_workload_loads():
    for name in WORKLOADS:
        wl = load_workload(name, DATA_DIR, num_prompts=2)
        assert len(wl.requests) == 2 and all(r.turns and all(r.turns) for r in wl.requests), name
    assert load_workload("mt_bench", DATA_DIR, num_prompts=3).num_generations == 6
    assert load_workload("bfcl", DATA_DIR, num_prompts=1).requests[0].tools


def test_mt_bench_second_turn_carries_first_answer(tmp_path):
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.tiny import ensure_tiny_target
    from dmtp_jax.tokenizer import load_tokenizer
    from workload_fixtures import write_small_workloads

    target_dir = ensure_tiny_target(str(tmp_path / "tiny"))
    tok = load_tokenizer(target_dir)
    wl = load_workload("mt_bench", write_small_workloads(str(tmp_path / "data")), num_prompts=2)
    runs = run_benchmark(make_decoders(["ar"], load_target(target_dir), {}), wl, tok, max_new_tokens=6,
                         batch_size=2, stop_ids=[], retime=False)
    gens = runs["ar"].generations
    assert [(g.request_id, g.turn) for g in gens] == [("81", 0), ("82", 0), ("81", 1), ("82", 1)]
    for first, second in zip(gens[:2], gens[2:]):
        prompt2 = tok.decode(second.prompt_ids)
        assert tok.decode(first.prompt_ids) in prompt2
        assert tok.decode(first.output_ids, skip_special_tokens=True) in prompt2
        assert prompt2.endswith(wl.requests[int(first.request_id) - 81].turns[1])
    report = build_report(runs, {"workload": wl.name})
    assert report["methods"]["ar"]["generations"] == 4 and report["methods"]["ar"]["new_tokens"] == 24


def test_demo_methods_share_one_drafting_head(monkeypatch):
    """The demo bench loads each method's own drafter (dflash, dmtp: different directories) but
    builds the drafting head once, with the demo's token counts, for every speculative method."""
    import argparse

    from dmtp_jax.decode import loading
    heads, counts = [], []

    def make_draft_head(target, kind, rank, shortlist, counts_v, subset, factor):
        counts.append(counts_v)
        heads.append(object())
        return heads[-1]
    monkeypatch.setattr(loading, "make_draft_head", make_draft_head)
    monkeypatch.setattr(loading, "read_token_counts", lambda path, vocab: path)
    monkeypatch.setattr(loading, "MODEL_LOADERS", {k: (lambda a, t, m: a.draft, share_key(k))
                                                   for k in ("drafter", "mtp", "fusion")})
    args = infer.build_parser().parse_args(["bench", "--draft-head", "efficient", "--draft-head-vocab", "8"])
    if not uses_demo(args):
        pytest.fail("the demo checkpoints are part of the repository")
    methods = ["ar", "mtp", "dflash", "dmtp"]
    models = method_models(args, argparse.Namespace(cfg=argparse.Namespace(vocab_size=128)), methods)
    assert len(heads) == 1 and counts == [os.path.join(DEMO_DIR, "dmtp")]
    assert models["ar"] == {}
    assert all(models[m]["draft_head"] is heads[0] for m in ("mtp", "dflash", "dmtp"))
    assert models["dflash"]["drafter"] != models["dmtp"]["drafter"]           # each its own demo drafter


LONG = "dmtp-adaptive (corpus-only MTP)"


def _columns_align(table: str, header_word: str) -> None:
    """Every row of `table` from its header on has the same width and starts its second column where
    the header does."""
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method"))
    rows = lines[head:]
    second = rows[0].index(header_word) + len(header_word)      # right-aligned column: its end
    assert len({len(r) for r in rows}) == 1, table
    assert all(r[second - 1] != " " and r[second] == " " for r in rows), table


def test_tables_align_with_a_long_method_name():
    """The bench's tables size the method column to the longest name (dmtp-adaptive rows, variants)."""
    from dmtp_jax.bench.efficiency import format_efficiency
    from dmtp_jax.bench.phases import PHASES, format_phases
    from dmtp_jax.bench.runner import MethodRun
    report = build_report({"ar": MethodRun("ar", new_tokens=10, wall_s=1.0),
                           LONG: MethodRun(LONG, new_tokens=20, wall_s=1.0)}, {})
    _columns_align(format_table(report), "tau/req")
    eff = {"ar": {"batch": 1, "max_len": 128, "bytes_per_round": 2e7, "min_bytes_per_round": 1.8e7,
                  "bytes_ratio": 1.1, "bytes_per_token": 2e7, "flops_per_round": 6e6, "flops_per_token": 6e6}}
    eff[LONG] = dict(eff["ar"])
    _columns_align(format_efficiency(eff), "shape")
    phase = {"batch": 1, "max_len": 128, "phases_ms": dict.fromkeys(PHASES, 1.5), "sum_ms": 7.5, "round_ms": 6.0}
    _columns_align(format_phases({"dmtp": phase, LONG: phase}), "shape")


def test_plot_legend_shows_the_tables_tau_per_verify():
    """The acceptance plot's legend gives each method the tau/ver its table row prints, `auto`'s
    (two methods served it) included."""
    from dmtp_jax.bench.report import legend_label
    from dmtp_jax.bench.runner import Generation, MethodRun
    runs = {"dmtp": MethodRun("dmtp", [Generation("a", 0, [1], [5] * 9, [4, 4]),
                                       Generation("b", 0, [1], [5] * 8, [2, 3, 2])], block_size=8,
                              new_tokens=17, wall_s=1.0),
            "auto": MethodRun("auto", [Generation("a", 0, [1], [5] * 9, [3, 3, 2], None, "mtp"),
                                       Generation("b", 0, [1], [5] * 8, [2, 3, 2], None, "dmtp")],
                              block_size=8, new_tokens=17, wall_s=1.0)}
    report = build_report(runs, {})
    rows = {line.split()[0]: line.split()[2] for line in format_table(report).splitlines()[1:]}
    for name, m in report["methods"].items():
        assert legend_label(name, m) == f"{name} (tau/ver {rows[name]})"
    assert rows["auto"] == f"{(3 + 3 + 2 + 2 + 3 + 2) / 6:.3f}"     # every round of both generations
