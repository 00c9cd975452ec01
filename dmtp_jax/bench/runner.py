"""Runs decode methods over a workload: batches, multi-turn prompts, timing without compiles.

Per method: one untimed warm-up generate on the first batch, then the requests in batches of
`batch_size`, turn by turn (turn k+1 carries the model's own answers). Each generate call is timed
around `decoder.generate` (prefill included); a call that compiled (`compile_counts()` changed) is
re-run with the same seed and the re-run timed. A generation whose prompt + `max_new_tokens`
exceeds `max_position_embeddings` is skipped with its later turns (`MethodRun.skipped`).
Decoders come from `make_decoders` (`decode.make_decoder`, given only the keywords it accepts)."""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from dmtp_jax.bench.workloads import Request, Workload, check_tokenizer, render_prompt
from dmtp_jax.decode.auto import timed_generate
from dmtp_jax.decode.batch import RequestError


@dataclasses.dataclass
class Generation:
    """One generate row: a request's turn, prompt and output ids, and (speculative methods) the tokens
    committed by each verify round."""
    request_id: str
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    acceptance_lengths: list[int] | None = None
    t1_from_mtp: list[bool] | None = None    # per round: the first candidate was MTP's (dmtp-adaptive)
    method: str | None = None                # auto: the candidate that decoded it


@dataclasses.dataclass
class MethodRun:
    """Everything measured for one method over the workload (timed calls only)."""
    method: str
    generations: list[Generation] = dataclasses.field(default_factory=list)
    block_size: int | None = None        # verify slots per round; None for plain decoding
    wall_s: float = 0.0                  # sum of timed generate calls
    decode_s: float = 0.0                # sum of the engines' decode time (prefill excluded)
    new_tokens: int = 0
    calls: int = 0
    loop_steps: int = 0                  # decode-loop iterations (rounds / AR steps) over all calls
    retimed_calls: int = 0               # calls re-run because they compiled
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, int]] = dataclasses.field(default_factory=list)   # (request id, turn)
    compiles: dict = dataclasses.field(default_factory=dict)
    exactness_probe: dict | None = None  # the speculative decoder's probe verdict (decode/probe.py)
    shapes: dict = dataclasses.field(default_factory=dict)   # (batch bucket, cache length) -> loop steps
    auto: dict = dataclasses.field(default_factory=dict)     # `auto`: batch bucket -> its verdict (as_dict)

    @property
    def speculative(self) -> bool:
        return self.block_size is not None


# ---- running ----------------------------------------------------------------------------------
def _counts(decoder):
    fn = getattr(decoder, "compile_counts", None)
    return fn() if fn else None


def _decode_answer(tokenizer, output_ids, stop_ids) -> str:
    ids = [t for t in output_ids if t not in stop_ids]
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_method(name: str, decoder, workload: Workload, tokenizer, *, max_new_tokens: int,
               batch_size: int = 1, sampling=None, seed: int = 0, stop_ids=(), max_positions: int | None = None,
               retime: bool = True, progress: bool = False) -> MethodRun:
    """Runs one decoder over the workload: its `MethodRun`."""
    if batch_size < 1:
        raise RequestError(f"--batch-size must be >= 1, got {batch_size}")
    check_tokenizer(workload, tokenizer)
    stop_ids = sorted(set(int(s) for s in stop_ids))
    run = MethodRun(name)
    requests = list(workload.requests)
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    fits = (lambda p: True) if max_positions is None else (lambda p: len(p) + max_new_tokens <= max_positions)

    warm = [p for p in (render_prompt(r, tokenizer, []) for r in batches[0]) if fits(p)]
    if warm:
        decoder.generate(warm, max_new_tokens, sampling, seed, stop_ids)

    bar = tqdm(total=workload.num_generations, desc=f"bench {name}", unit="gen", disable=not progress,
               leave=False)
    try:
        for batch in batches:
            _run_batch(run, decoder, batch, tokenizer, fits, max_new_tokens, sampling, seed, stop_ids,
                       retime, bar)
    finally:
        bar.close()
    run.compiles = _counts(decoder) or {}
    return run


def _run_batch(run: MethodRun, decoder, batch: list[Request], tokenizer, fits, max_new_tokens, sampling,
               seed, stop_ids, retime, bar) -> None:
    answers: dict[int, list[str]] = {i: [] for i in range(len(batch))}
    alive = set(range(len(batch)))
    for turn in range(max(r.num_turns for r in batch)):
        rows, prompts = [], []
        for i, req in enumerate(batch):
            if turn >= req.num_turns:
                continue
            if i not in alive:
                run.skipped.append((req.id, turn))
                bar.update(1)
                continue
            prompt = render_prompt(req, tokenizer, answers[i])
            if not fits(prompt):
                run.skipped.append((req.id, turn))
                alive.discard(i)
                bar.update(1)
                continue
            rows.append(i)
            prompts.append(prompt)
        if not rows:
            continue
        try:
            result, wall, retimed = timed_generate(decoder, prompts, max_new_tokens, sampling,
                                                   seed + run.calls, stop_ids, retime)
        except RequestError as e:
            raise RequestError(f"requests {[batch[i].id for i in rows]} turn {turn + 1}: {e}") from None
        stats = result.stats
        run.exactness_probe = stats.get("exactness_probe", run.exactness_probe)
        served = None
        if "auto" in stats:
            run.auto[stats["auto"]["batch_bucket"]] = stats["auto"]      # the latest verdict of each bucket
            served = stats["auto"]["method"]
        acceptance = stats.get("acceptance_lengths")
        sources = stats.get("t1_from_mtp")
        if acceptance is not None:
            # the widest block of the run (auto may choose methods of different blocks per batch bucket)
            run.block_size = max(run.block_size or 0, int(stats.get("block_size") or len(stats["histogram"])))
        run.calls += 1
        run.retimed_calls += int(retimed)
        run.wall_s += wall
        run.decode_s += float(stats.get("decode_s", 0.0))
        run.loop_steps += max(0, int(stats.get("target_forwards", 1)) - 1)
        shape = (int(stats.get("batch_bucket", len(rows))), int(stats.get("max_len", 0)))
        run.shapes[shape] = run.shapes.get(shape, 0) + max(0, int(stats.get("target_forwards", 1)) - 1)
        run.ttft_s.append(float(stats.get("ttft_s", 0.0)))
        for j, i in enumerate(rows):
            out = list(map(int, result.output_ids[j]))
            run.generations.append(Generation(batch[i].id, turn, list(map(int, prompts[j])), out,
                                              None if acceptance is None else list(acceptance[j]),
                                              None if sources is None else list(sources[j]), served))
            run.new_tokens += len(out)
            if batch[i].is_text and turn + 1 < batch[i].num_turns:
                answers[i].append(_decode_answer(tokenizer, out, stop_ids))
        bar.update(len(rows))


def run_benchmark(decoders: dict, workload: Workload, tokenizer, **kwargs) -> dict[str, MethodRun]:
    """`{method: MethodRun}`: `run_method` for every decoder, in order; `kwargs` go to `run_method`."""
    check_tokenizer(workload, tokenizer)
    return {name: run_method(name, dec, workload, tokenizer, **kwargs) for name, dec in decoders.items()}
