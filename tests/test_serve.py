"""The server (`dmtp_jax/serve/`): continuous batching equals `generate` token for token (engine
level, rows joining mid-flight, greedy and sampled rows sharing a batch), and the HTTP API through
the real `openai` client against a server on a free local port (streaming, stop strings, errors,
disconnects, /metrics). One tiny random Qwen3 target with an MTP head, a DFlash drafter and a DMTP
fusion, built in JAX (no torch); a few LM-head columns scaled up so drafts are partly accepted."""

import numpy as np
import pytest

from dmtp_jax.serve.engine import Engine, Request, insert_row

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17], [7, 7, 7]]
MAX_TOKENS = [20, 9, 30, 14, 25]
MAX_MODEL_LEN = 120     # cache 128 slots, as generate's: the prefill compile is shared


@pytest.fixture(scope="module")
def decoder():
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.hf import init_target
    from dmtp_jax.checkpoint.mtp_ckpt import init_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.tiny import tiny_target_config

    cfg = tiny_target_config()
    target = init_target(cfg, "float32", seed=0)
    head = target.state["lm_head"]
    head[...] = head[...].at[:, 10:40].multiply(6.0)       # peaked: drafters sharing the head agree often
    drafter = init_drafter(default_drafter_config(cfg, num_layers=1, block_size=4), seed=2)
    return make_decoder("dmtp", target, drafter, mtp=init_mtp(cfg, seed=1),
                        fusion=init_fusion("dmtp", cfg.hidden_size, cfg.rms_norm_eps, seed=3))


@pytest.fixture(scope="module")
def reference(decoder):
    """`generate` of each prompt alone, greedy, no stop tokens."""
    return [decoder.generate([p], m, stop_ids=[]).output_ids[0] for p, m in zip(PROMPTS, MAX_TOKENS)]


def test_insert_row_finds_each_leafs_batch_axis():
    state = {"k": np.zeros((2, 3, 4)), "n": np.zeros(3)}
    out = insert_row(state, {"k": np.ones((2, 1, 4)), "n": np.full(1, 7.0)}, 1)
    assert out["k"].sum(axis=(0, 2)).tolist() == [0.0, 8.0, 0.0] and out["n"].tolist() == [0.0, 7.0, 0.0]


def test_continuous_batching_equals_generate(decoder, reference):
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[])
    reqs = [engine.add(Request(PROMPTS[0], MAX_TOKENS[0])), engine.add(Request(PROMPTS[1], MAX_TOKENS[1]))]
    steps, joined = 0, False
    while engine.busy:
        engine.step()
        steps += 1
        if steps == 3:      # more than the free rows join mid-flight, a sampled row among them
            reqs += [engine.add(Request(p, m)) for p, m in zip(PROMPTS[2:], MAX_TOKENS[2:])]
            sampled = engine.add(Request([1, 2, 3], 12, temperature=0.8, top_p=0.9, seed=1))
            joined = True
    assert joined and [r.output_ids for r in reqs] == reference
    assert all(r.finish_reason == "length" for r in reqs) and len(sampled.output_ids) == 12
    accepted = [a for r in reqs for a in r.acceptance]
    assert max(accepted) > 1, "drafts should be partly accepted"
    counts = engine.compile_counts()
    assert counts["insert_row"] == 1 and counts["round"] <= 3     # generate's + the engine's greedy + sampled


def test_stop_tokens_and_cancel_free_rows(decoder, reference):
    engine = Engine(decoder, max_batch_size=2, max_model_len=MAX_MODEL_LEN, stop_ids=[])
    stop = reference[2][5]
    a = engine.add(Request(PROMPTS[2], MAX_TOKENS[2], stop_ids=(stop,)))
    b = engine.add(Request(PROMPTS[0], MAX_TOKENS[0]))
    c = engine.add(Request(PROMPTS[3], MAX_TOKENS[3]))       # waits for a free row
    while not b.output_ids:
        engine.step()
    engine.cancel(b)
    while engine.busy:
        engine.step()
    assert a.output_ids == reference[2][:reference[2].index(stop) + 1] and a.finish_reason == "stop"
    assert b.finish_reason == "cancelled" and len(b.output_ids) < MAX_TOKENS[0]
    assert c.output_ids == reference[3]
