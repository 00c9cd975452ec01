"""Scale-out (docs/scale-out.md): two `infer.py serve` replicas of the shipped demo behind
`sglang-router` with cache-aware routing, as processes on this machine. Greedy completions through
the router equal one replica's own answers, and requests sharing a long prefix all land on the one
replica that served it first (each replica's `/metrics` `dmtp_requests_total`), where its prefix
cache (`--prefix-cache-gb`) reuses it. Needs the `scale` extra (`pip install -e .[scale]`)."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve_fixtures import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "demo", "target")
PROMPTS = ["def __init__(self, name):\n", "import os\nimport sys\n", "class Parser:\n    \"\"\"",
           "    for key, value in items:\n", "# Copyright 2001 Python Software Foundation\n", "return self."]
PREFIX = ("class ConfigParser(RawConfigParser):\n    \"\"\"ConfigParser implementing interpolation.\"\"\"\n\n"
          "    def get(self, section, option, *, raw=False, vars=None, fallback=_UNSET):\n"
          "        \"\"\"Get an option value for a given section.\"\"\"\n")
SUFFIXES = ["        if ", "        try:\n", "        return ", "        d = ", "        for ", "        #"]
MAX_TOKENS = 8

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_TARGET, "model.safetensors")),
                                 reason="no shipped demo"),
              pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                 reason="sglang-router is not installed (pip install -e .[scale])")]


def requests_total(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(float(re.search(r"^dmtp_requests_total (\S+)$", text, re.M).group(1)))


def complete(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=600,
                   json={"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stop(proc, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_two_replicas_behind_sglang_router_answer_as_one_and_keep_prefixes_together(tmp_path):
    procs, ports = [], [free_port() for _ in range(2)]
    try:
        for i, port in enumerate(ports):        # in parallel: each warm-up takes a minute or two
            with open(tmp_path / f"replica{i}.log", "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "infer.py", "serve", "--method", "ar", "--max-batch-size", "2",
                     "--max-model-len", "256", "--prefix-cache-gb", "0.05", "--served-model-name", "demo",
                     "--port", str(port)],
                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True))
        replicas = [f"http://127.0.0.1:{p}" for p in ports]
        for proc, url in zip(procs, replicas):
            wait_healthy(proc, url, timeout_s=1200)

        port, metrics_port = free_port(), free_port()
        with open(tmp_path / "router.log", "w") as out:
            router = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *replicas, "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
                 "--shutdown-grace-period-secs", "5", "--log-level", "warn"],
                stdout=out, stderr=subprocess.STDOUT, text=True)
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120            # the router answers once both workers are registered
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            assert time.time() < deadline, (tmp_path / "router.log").read_text()[-3000:]
            try:
                workers = httpx.get(url + "/workers", timeout=5).json()
                if sum(w["is_healthy"] for w in workers["workers"]) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(1)

        # the same greedy texts through the router (concurrently: both replicas serve) as from one replica
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            routed = list(pool.map(lambda p: complete(url, p), PROMPTS))
        direct = [complete(replicas[0], p) for p in PROMPTS]
        assert routed == direct
        assert all(routed), routed

        # a conversation's turns, each prompt the previous one and its answer and more: every turn goes
        # to the replica that holds the shared prefix, whose prefix cache resumes it
        hits_of = lambda r: float(re.search(r"^dmtp_prefix_cache_hits_total (\S+)$",
                                            httpx.get(r + "/metrics", timeout=30).text, re.M).group(1))
        before = [(requests_total(r), hits_of(r)) for r in replicas]
        prompts, answers = [PREFIX + SUFFIXES[0]], []
        for s in SUFFIXES[1:] + [None]:
            answers.append(complete(url, prompts[-1]))
            if s is not None:
                prompts.append(prompts[-1] + answers[-1] + s)
        after = [(requests_total(r), hits_of(r)) for r in replicas]
        landed = [a[0] - b[0] for a, b in zip(after, before)]
        assert sorted(landed) == [0, len(SUFFIXES)], landed
        hits = after[landed.index(len(SUFFIXES))][1] - before[landed.index(len(SUFFIXES))][1]
        assert hits >= 1, (hits, landed)
        assert answers == [complete(replicas[0], p) for p in prompts]
    finally:
        for proc in reversed(procs):
            stop(proc)
