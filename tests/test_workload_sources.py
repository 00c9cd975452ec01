"""Where named bench workloads come from (`bench/sources.py`): an explicit local directory, else
the hub through `datasets` (faked here: tests never touch the network), else the checkout's shared
data; neither is one error saying why. Hub noise stays off stderr."""

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
