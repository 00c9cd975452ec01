"""Where named bench workloads come from (`bench/sources.py`): an explicit local directory, else
the hub through `datasets` (faked here: tests never touch the network), else the checkout's shared
data; neither is one error saying why. Hub noise stays off stderr. Every named workload's parser runs
on small files in the real layouts that the tests write (`workload_fixtures.py`), so a clean clone
without `../shared/data` checks them too."""

import json
import sys
import types

import pytest

import infer
from dmtp_jax.bench import sources
from dmtp_jax.bench.workloads import WorkloadError, load_workload

GSM8K = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}]


@pytest.fixture
def no_local(monkeypatch, tmp_path):
    monkeypatch.delenv(sources.DATA_ENV, raising=False)
    monkeypatch.setattr(sources, "sibling_data_dir", lambda: str(tmp_path / "no-shared-data"))
    return tmp_path


def fake_datasets(monkeypatch, load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def local_copy(root):
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K[:1]))
    return str(root)


def test_the_hub_serves_a_named_workload_quietly(no_local, monkeypatch, capfd):
    asked = []

    def load_dataset(path, name=None, split=None, data_files=None):
        asked.append((path, name, split))
        return GSM8K

    fake_datasets(monkeypatch, load_dataset)
    wl = load_workload("gsm8k", num_prompts=2)
    assert asked == [("openai/gsm8k", "main", "test")] and wl.source == "hub:openai/gsm8k"
    assert [r.turns[0].split("\n")[0] for r in wl.requests] == ["1 + 1?", "2 + 2?"]
    assert capfd.readouterr().err == ""


def test_an_explicit_directory_wins_and_the_hub_is_not_asked(no_local, monkeypatch):
    def load_dataset(*a, **k):
        raise AssertionError("the hub was asked although --data-dir was given")

    fake_datasets(monkeypatch, load_dataset)
    root = local_copy(no_local / "mine")
    assert load_workload("gsm8k", root).source == f"{root}/gsm8k/test.jsonl"
    monkeypatch.setenv(sources.DATA_ENV, root)
    assert len(load_workload("gsm8k").requests) == 1


def test_an_unreachable_hub_falls_back_to_the_checkout_data(no_local, monkeypatch):
    def load_dataset(*a, **k):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    fake_datasets(monkeypatch, load_dataset)
    shared = local_copy(no_local / "shared")
    monkeypatch.setattr(sources, "sibling_data_dir", lambda: shared)
    assert load_workload("gsm8k").source == f"{shared}/gsm8k/test.jsonl"


def test_neither_hub_nor_local_is_one_error_saying_why(no_local, monkeypatch, tiny_qwen3_dir, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)          # not installed
    with pytest.raises(WorkloadError, match=r"workload 'gsm8k' could not be loaded: not from the hub \(the "
                                            r"`datasets` library is not installed\) and no local directory"):
        load_workload("gsm8k")
    with pytest.raises(WorkloadError, match="spec_bench.*it has no hub source here"):
        load_workload("spec_bench")
    assert infer.main(["bench", "--target", tiny_qwen3_dir, "--workload", "gsm8k"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: workload 'gsm8k' could not be loaded")
    assert lines[1] == ("hint: pass --data-dir DIR with gsm8k/test.jsonl under DIR "
                        "(pip install 'dmtp-jax[data]' for the hub)")


@pytest.fixture
def small_data(tmp_path):
    from workload_fixtures import write_small_workloads
    return write_small_workloads(str(tmp_path / "data"))


@pytest.mark.parametrize("name", ["gsm8k", "math500", "humaneval", "mt_bench", "alpaca_eval", "spec_bench", "bfcl"])
def test_every_named_workload_parses_its_file_layout(small_data, name):
    from dmtp_jax.bench.workloads import WORKLOADS
    from workload_fixtures import EXPECTED
    wl = load_workload(name, small_data)
    assert wl.source == ",".join(f"{small_data}/{f}" for f in WORKLOADS[name].files)
    got = [(r.id, r.turns, r.system, tuple(t["name"] for t in r.tools) if r.tools else None) for r in wl.requests]
    assert got == EXPECTED[name]
    assert wl.num_generations == sum(len(turns) for _, turns, _, _ in EXPECTED[name])


def test_a_bad_record_in_a_named_workload_is_one_error(small_data):
    from pathlib import Path
    path = Path(small_data) / "mt_bench" / "question.jsonl"
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(WorkloadError, match=r"mt_bench/question.jsonl: record 3: bad JSON"):
        load_workload("mt_bench", small_data)
    path.write_text('{"question_id": 1}\n')
    with pytest.raises(WorkloadError, match="unexpected record layout"):
        load_workload("mt_bench", small_data)
