"""`infer.py serve --method auto` as a user starts it (the shipped demo, the default batch size), as a
process: its warm-up shows its progress and compiles few programs within the host's memory maps,
it answers as `generate` would, and SIGTERM ends it with status 0. The warm-up's memory-map budget
(`serve/warmup.py:MapBudget`) refuses, in one error line, a program set the host could not hold."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from dmtp_jax.errors import InputError
from dmtp_jax.serve.warmup import CompileJob, MapBudget
from tests.serve_fixtures import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "demo", "target")
PROMPT = [3, 14, 15, 92, 65, 35]
MAX_TOKENS = 12
MAX_PROGRAMS = 64           # the default auto server's program set on the demo (issue 67's bound)


def process_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as fh:
        return sum(1 for _ in fh)


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_TARGET, "model.safetensors")), reason="no shipped demo")
def test_serve_auto_starts_at_the_default_batch_size_and_answers_as_generate(tmp_path):
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode import make_decoder

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "infer.py", "serve", "--method", "auto", "--port", str(port)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=1200)
        text = log.read_text()
        assert "compiling" in text and "program" in text, text[-2000:]      # tqdm's bar on stderr
        programs = int(text.split("compiled ")[1].split(" programs")[0])
        assert 0 < programs <= MAX_PROGRAMS, text[-2000:]
        if os.path.exists("/proc/sys/vm/max_map_count"):
            limit = int(open("/proc/sys/vm/max_map_count").read())
            assert process_maps(proc.pid) < limit / 2, (process_maps(proc.pid), limit)
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        got = [httpx.post(url + "/v1/completions", json=body, timeout=300) for _ in range(2)]
        assert all(r.status_code == 200 for r in got), [r.text for r in got]
        metrics = httpx.get(url + "/metrics", timeout=30).text       # a request compiled nothing
        assert f"dmtp_compiled_programs {programs}" in metrics, metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    target = load_target(DEMO_TARGET, "float32")
    want = make_decoder("ar", target).generate([PROMPT], MAX_TOKENS).output_ids[0]
    from dmtp_jax.tokenizer import load_tokenizer
    want_text = load_tokenizer(DEMO_TARGET, plain=True).decode(want)
    assert [json.loads(r.text)["choices"][0]["text"] for r in got] == [want_text, want_text]


def test_map_budget_refuses_a_program_set_past_the_limit(tmp_path):
    """Two compiled programs took 100 maps each: 10 more of that family would pass 80 % of a limit of
    1,000 maps, and the budget says so before compiling them, naming vm.max_map_count."""
    maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
    limit.write_text("1000\n")
    maps.write_text("x\n" * 100)
    budget = MapBudget(str(maps), str(limit))
    for _ in range(2):
        before = budget.maps()
        maps.write_text("x\n" * (before + 100))
        budget.record("round/dmtp", before)
    assert budget.maps() == 300 and budget.per_family == {"round/dmtp": [100, 100]}
    job = CompileJob("round/dmtp", "dmtp round", lambda: None)
    budget.check([job] * 4, total=6)                   # 300 + 400 <= 800: fits
    with pytest.raises(InputError, match="vm.max_map_count") as err:
        budget.check([job] * 10, total=12)             # 300 + 1,000 > 800
    assert "1,300 memory maps" in str(err.value) and "max-batch-size" in err.value.hint
    assert MapBudget(str(maps), str(tmp_path / "absent")).limit is None     # no limit known: no check
