"""`--method auto`: measure the methods the models allow on the first request, keep the fastest.

`AutoDecoder` holds one decoder per candidate method (`ar` and every speculative method the models
allow). On the first requests of a batch bucket it probes each candidate on the request's prompts
(compiles excluded, a seed of its own, outputs dropped) and decodes with the method of the highest
decode tokens/s (`probe_measurement`). Outputs are the chosen method's: greedy equals `ar` token
for token, sampled is lossless. Verdicts are kept per models, device, dtype, batch bucket and mode
in `VerdictStore` (no prompt text or token id is stored). Behaviour and measurements:
docs/generate.md#auto---method-auto."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys
import time

import jax

from dmtp_jax.decode.batch import RequestError, next_pow2
from dmtp_jax.paths import cache_root
from dmtp_jax.decode.sampling import SamplingParams

AUTO = "auto"
DEFAULT_PROBE_TOKENS = 64       # new tokens per candidate and probe run (about a dozen rounds of a 8-slot method)
PROBE_SEED_OFFSET = 0x5EED      # the probes' seed: seed + offset, never the request's own
MIN_PROBE_ROWS = 4              # a verdict rests on at least this many rows' probes (batch 1: 4 requests)
MAX_PROBE_REQUESTS = 8          # a bucket's verdict is final after this many probed requests at most


def timed_generate(decoder, prompts, max_new_tokens, sampling, seed, stop_ids, retime: bool = True):
    """`(result, wall_s, retimed)`: one generate call timed; re-run (same seed) if it compiled, so no
    compile time is counted."""
    counts = getattr(decoder, "compile_counts", None)
    before = counts() if counts else None
    t0 = time.perf_counter()
    result = decoder.generate(prompts, max_new_tokens, sampling, seed, stop_ids)
    wall = time.perf_counter() - t0
    if retime and before is not None and counts() != before:
        t0 = time.perf_counter()
        result = decoder.generate(prompts, max_new_tokens, sampling, seed, stop_ids)
        return result, time.perf_counter() - t0, True
    return result, wall, False


def fingerprint(model_dir: str | None) -> str | None:
    """A short hash naming a checkpoint directory by its files (config.json; each safetensors file's
    name, size, first and last MiB), not by its path; None for None."""
    if model_dir is None:
        return None
    h = hashlib.sha1()
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name == "config.json":
            with open(path, "rb") as fh:
                h.update(fh.read())
        elif name.endswith(".safetensors"):
            size = os.path.getsize(path)
            h.update(f"{name}:{size}".encode())
            with open(path, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read())
    return h.hexdigest()[:16]


class VerdictStore:
    """Auto's verdicts by key, in memory and (with a `path`) in a JSON file written atomically; an
    unreadable file is reported once and replaced."""

    FILE = "auto-verdicts.json"

    def __init__(self, path: str | None):
        self.path = path
        self.verdicts: dict[str, dict] = {}
        if path and os.path.isfile(path):
            try:
                with open(path) as fh:
                    self.verdicts = dict(json.load(fh))
            except (OSError, ValueError, TypeError) as e:
                print(f"warning: ignoring the unreadable auto verdicts in {path} ({e}); they are measured again",
                      file=sys.stderr)

    @classmethod
    def default(cls) -> "VerdictStore":
        """The store at `$DMTP_JAX_CACHE/auto-verdicts.json` (default `~/.cache/dmtp-jax`)."""
        return cls(os.path.join(cache_root(), cls.FILE))

    def get(self, key: str) -> dict | None:
        return self.verdicts.get(key)

    def put(self, key: str, record: dict) -> None:
        self.verdicts[key] = record
        if not self.path:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(self.verdicts, fh, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:            # an unwritable cache is no reason to fail: the verdict stays in memory
            print(f"warning: could not write {self.path} ({e}); the verdict is kept for this run only",
                  file=sys.stderr)


@dataclasses.dataclass
class Verdict:
    """The method auto decodes a batch bucket with, and what it was chosen from."""
    method: str
    source: str                     # "measured" (final, this call), "provisional" (measured, not final yet),
                                    # "cache" (memory / file) or "single" (one candidate)
    measured: dict                  # method -> {"decode_tokens_per_s", "tau_per_verify", "round_s", ...}
    batch_bucket: int
    measure_s: float = 0.0          # wall time the measurement took (0 when not measured now)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def decode_tokens(stats: dict) -> float:
    """Tokens a generate call decoded after each row's first (decode rate x decode time)."""
    return stats["decode_tokens_per_s"] * stats["decode_s"]


def describe_verdict(verdict: dict) -> str:
    """A verdict (`Verdict.as_dict()`) in one line: the method, its source, each candidate's decode
    tokens/s and tokens per verify.

    Example:
        >>> describe_verdict({"method": "dmtp", "source": "measured", "measure_s": 2.0, "batch_bucket": 1,
        ...     "measured": {"ar": {"decode_tokens_per_s": 50.0, "tau_per_verify": 1.0},
        ...                  "dmtp": {"decode_tokens_per_s": 80.0, "tau_per_verify": 4.2}}})
        'batch bucket 1: dmtp (measured in 2.0 s; decode tok/s ar 50.0 (tau 1.00), dmtp 80.0 (tau 4.20))'
    """
    seen = ", ".join(f"{c} {x['decode_tokens_per_s']:.1f} (tau {x['tau_per_verify']:.2f})"
                     + (" declined" if x.get("declined") else "") for c, x in verdict["measured"].items())
    how = {"measured": f"measured in {verdict.get('measure_s', 0.0):.1f} s", "cache": "cached verdict",
           "provisional": "provisional: probed on {} request(s) so far".format(
               max([x.get("probe_requests", 0) for x in verdict["measured"].values()] + [0])),
           "single": "the only candidate"}.get(verdict["source"], verdict["source"])
    return (f"batch bucket {verdict['batch_bucket']}: {verdict['method']} ({how}"
            + (f"; decode tok/s {seen}" if seen else "") + ")")


def fastest(measured: dict) -> str:
    """The candidate of the highest decode tokens/s among those not declined (ties: the first)."""
    usable = {m: v for m, v in measured.items() if not v.get("declined")}
    if not usable:
        raise RequestError("auto: every candidate method was declined")
    return max(usable, key=lambda m: usable[m]["decode_tokens_per_s"])


def probe_measurement(runs: list[dict]) -> dict:
    """What a method's probe runs (their generate stats) say of it: tokens per verify, the fastest round
    (noise only adds time), decode tokens/s as decode tokens per round over that round time, and
    `declined` when the exactness probe sent it to plain decoding.

    Example:
        >>> probe_measurement([{"decode_tokens_per_s": 40.0, "decode_s": 0.5, "target_forwards": 11,
        ...                     "per_verify_acceptance_length": 2.0},
        ...                    {"decode_tokens_per_s": 20.0, "decode_s": 1.0, "target_forwards": 11,
        ...                     "per_verify_acceptance_length": 2.0}])
        {'decode_tokens_per_s': 40.0, 'tau_per_verify': 2.0, 'round_s': 0.05, 'declined': False}
    """
    rounds = [max(1, int(s.get("target_forwards", 1)) - 1) for s in runs]
    round_s = min(float(s["decode_s"]) / r for s, r in zip(runs, rounds))
    per_round = sum(decode_tokens(s) for s in runs) / sum(rounds)
    return {"decode_tokens_per_s": per_round / round_s if round_s > 0 else 0.0,
            "tau_per_verify": sum(float(s.get("per_verify_acceptance_length", 1.0)) for s in runs) / len(runs),
            "round_s": round_s,
            "declined": any(bool(s.get("declined_method")) for s in runs)}


class AutoDecoder:
    """The fastest of `candidates` (`{method: decoder}`, all on one target), measured per batch bucket.
    Same `generate` contract as the other decoders; `stats["auto"]` holds the verdict, the other
    stats are the chosen method's. `store`: where verdicts persist (`VerdictStore.default()` when
    None); `probe_tokens`: new tokens per probe run; `repeats`: probe runs per candidate."""

    method = AUTO

    def __init__(self, candidates: dict, *, store: VerdictStore | None = None,
                 probe_tokens: int = DEFAULT_PROBE_TOKENS, repeats: int = 3):
        if not candidates:
            raise RequestError("auto needs at least one candidate method")
        if probe_tokens < 2:
            raise RequestError(f"auto: probe_tokens must be >= 2, got {probe_tokens}")
        self.candidates = dict(candidates)
        self.target = next(iter(self.candidates.values())).target
        self.prefill_chunk = next(iter(self.candidates.values())).prefill_chunk
        self.store = VerdictStore.default() if store is None else store
        self.probe_tokens, self.repeats = int(probe_tokens), int(repeats)
        self._identity = self._models_identity()
        self._pools: dict[str, dict] = {}      # verdict key -> probes pooled until the verdict is final
        self.measurements = 0                   # requests whose probes ran

    def _models_identity(self) -> dict:
        """What a verdict depends on besides the batch: models' fingerprints, device, dtype, options."""
        def options(dec):
            fields = {"slots": getattr(dec, "slots", 1), "verify": getattr(dec, "verify_mode", None),
                      "rounds_per_dispatch": getattr(dec, "rounds_per_dispatch", 1),
                      "adaptive_threshold": getattr(dec, "adaptive_threshold", None)}
            head = getattr(dec, "draft_head", None)
            fields["draft_head"] = None if head is None else dict(head.cfg)
            for kind in ("drafter", "mtp"):
                model = getattr(dec, kind, None)
                fields[kind] = None if model is None else fingerprint(model.model_dir) or "in-memory"
            return fields
        device = jax.devices()[0]
        return {"target": fingerprint(self.target.model_dir) or "in-memory",
                "device": f"{device.platform}:{device.device_kind}", "devices": jax.device_count(),
                "dtype": str(self.target.state_dtype),
                "candidates": {m: options(d) for m, d in self.candidates.items()}}

    def key(self, batch_bucket: int, greedy: bool) -> str:
        """The verdict key of a batch bucket: a hash of the identity, the bucket and the mode."""
        blob = json.dumps({**self._identity, "batch_bucket": batch_bucket, "greedy": greedy}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()

    def cached(self, rows: int, greedy: bool) -> Verdict | None:
        """The stored verdict for `rows` rows (their power-of-two bucket), or None."""
        bucket = next_pow2(rows)
        if len(self.candidates) == 1:
            return Verdict(next(iter(self.candidates)), "single", {}, bucket)
        record = self.store.get(self.key(bucket, greedy))
        if record is None or record.get("method") not in self.candidates:
            return None
        return Verdict(record["method"], "cache", record.get("measured", {}), bucket)

    def choose(self, prompts: list[list[int]], max_new_tokens: int, sampling=None, seed: int = 0,
               stop_ids=None, decide: bool = False) -> Verdict:
        """The verdict for this request's batch bucket: cached, else measured on `prompts` now.

        Probes use the request's stop tokens and are pooled with the bucket's next requests until
        `MIN_PROBE_ROWS` rows decoded a full probe, `MAX_PROBE_REQUESTS` requests were probed, or
        `decide=True`; until then the verdict is "provisional" (the fastest so far, not stored)."""
        sp = sampling or SamplingParams.make()
        verdict = self.cached(len(prompts), sp.is_greedy)
        if verdict is not None:
            return verdict
        bucket = next_pow2(len(prompts))
        budget = min(int(max_new_tokens), self.probe_tokens)
        if budget < 2:      # nothing is decoded after the first token: every method is the prefill
            return Verdict("ar" if "ar" in self.candidates else next(iter(self.candidates)), "single", {}, bucket)
        t0 = time.perf_counter()
        key = self.key(bucket, sp.is_greedy)
        pool = self._pools.setdefault(key, {"requests": 0, "tokens": 0.0, "seen": set(),
                                            "runs": {m: [] for m in self.candidates}})
        digest = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()     # in memory only
        if digest in pool["seen"]:      # the same prompts again: no new evidence, the verdict so far
            measured = self._pooled(pool, budget)
            return Verdict(fastest(measured), "provisional", measured, bucket)
        pool["seen"].add(digest)
        for r in range(self.repeats):   # round robin: a slow spell of the machine hits every method alike
            for method, dec in self.candidates.items():
                stats = timed_generate(dec, prompts, budget, sp, seed + PROBE_SEED_OFFSET + r, stop_ids)[0].stats
                pool["runs"][method].append(stats)
                if r == 0 and method == next(iter(self.candidates)):    # the evidence: tokens decoded
                    pool["tokens"] += decode_tokens(stats)
        pool["requests"] += 1
        self.measurements += 1
        measured = self._pooled(pool, budget)
        enough = pool["tokens"] >= (budget - 1) * MIN_PROBE_ROWS
        final = decide or enough or pool["requests"] >= MAX_PROBE_REQUESTS
        verdict = Verdict(fastest(measured), "measured" if final else "provisional", measured, bucket,
                          time.perf_counter() - t0)
        if final:
            del self._pools[key]
            self.store.put(key, {
                "method": verdict.method, "measured": measured, "batch_bucket": bucket, "greedy": sp.is_greedy,
                "target": os.path.basename(os.path.normpath(self.target.model_dir or "in-memory")),
                "device": self._identity["device"], "dtype": self._identity["dtype"],
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        return verdict

    @staticmethod
    def _pooled(pool: dict, budget: int) -> dict:
        return {m: {**probe_measurement(r), "probe_tokens": budget, "probe_requests": pool["requests"]}
                for m, r in pool["runs"].items()}

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling=None, seed: int = 0, stop_ids=None,
                 on_tokens=None):
        """Chooses (or recalls) the method for this batch bucket, then generates with it."""
        verdict = self.choose(prompts, max_new_tokens, sampling, seed, stop_ids)
        result = self.candidates[verdict.method].generate(prompts, max_new_tokens, sampling, seed, stop_ids,
                                                          on_tokens)
        st = result.stats
        st["auto"] = verdict.as_dict()
        st["method"] = f"auto:{st.get('method', verdict.method)}"
        if verdict.measure_s:       # the probes are part of what this request waited for
            decoded = decode_tokens(st)
            st["decode_s"] += verdict.measure_s
            st["decode_tokens_per_s"] = decoded / st["decode_s"]
        return result

    def compile_counts(self) -> dict[str, int]:
        """Every candidate's compile counts as `method/entry point`, and `measurements`: probe rounds run."""
        counts = {f"{m}/{k}": v for m, dec in self.candidates.items() for k, v in dec.compile_counts().items()}
        return {**counts, "measurements": self.measurements}
