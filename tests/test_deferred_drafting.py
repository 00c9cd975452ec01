"""Deferred drafting caches (`decode/drafting.py`): the plain rounds of a switching bank buffer their
rows, a full buffer catches up before the next plain round (`RoundBank.caught_up`), and `catch_up`
leaves the MTP cache, the MTP hidden and the drafter's context as advancing them every round does
(the tiny dmtp models of tests/serve_fixtures.py, fp32); no round copies the buffer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.decode.drafting import CATCH_UP_CHUNK, catch_up
from dmtp_jax.decode.prefill import prefill_chunks
from dmtp_jax.decode.round import merge_models
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.serve.rounds import RoundBank
from tests.serve_fixtures import PROMPTS, serve_decoder

WINDOW = 2 * CATCH_UP_CHUNK     # a short buffer of two catch-up blocks: the mechanism is the default's
ROUNDS = WINDOW + 20            # row 0 fills its buffer once (a two-block catch-up before a plain round),
                                # then 20 rows wait (again two blocks, the second partial)


def test_catch_up_equals_advancing_the_caches_every_round():
    dec = serve_decoder()
    bank = RoundBank.for_decoder(dec, switching=True)
    cfg, sp, key = dec.target.cfg, SamplingParams.make(), jax.random.key(0)
    batch = pad_prompts([PROMPTS[0], PROMPTS[2]], ROUNDS + 2, cfg.vocab_size, cfg.max_position_embeddings,
                        slack=bank.max_slots)
    states = bank.model_states()
    deferred = bank.new_state(2, batch.max_len, defer_window=WINDOW)
    assert deferred.deferred is not None and deferred.deferred.window == WINDOW
    for start, chunk_bt, next_b in prefill_chunks(batch.tokens_bt, bank.prefill_chunk):
        deferred, _ = bank.prefill_step(states, chunk_bt, next_b, start, batch.lengths_b, deferred, sp, key,
                                        greedy=True)     # and the first tokens' logprobs
    every = dataclasses.replace(jax.tree.map(jnp.copy, deferred), deferred=None)     # advanced every round
    limits = batch.lengths_b + ROUNDS + 2
    for i in range(ROUNDS):
        active = np.array([True, i < 11 or i >= ROUNDS - 2])        # row 1 pauses: the rows' lags differ
        deferred, tok_d, *_ = bank.run("ar", deferred, active, limits, sp, key, i + 1, True)
        every, tok_e, *_ = bank.run("ar", every, active, limits, sp, key, i + 1, True)
        assert np.array_equal(tok_d, tok_e)
    assert deferred.deferred.lag_b.tolist() == [20, 2]       # row 1's 11 caught up with row 0's 32
    lengths = np.asarray(deferred.lengths_b).tolist()
    assert lengths == np.asarray(every.lengths_b).tolist()

    assert not close(deferred, every, lengths)      # 20 and 2 rows wait
    caught = caught_up(bank, deferred)
    assert caught.deferred.lag_b.tolist() == [0, 0]
    assert close(caught, every, lengths)
    assert close(caught_up(bank, caught), every, lengths)      # nothing waits: nothing changes


def test_a_lean_prefill_caught_up_equals_a_full_one():
    """`prefill_step(defer=True)` runs the target alone and buffers the chunk's rows (fresh, and resumed
    at a position > 0 as a prefix cache hit is); caught up, its drafting caches are a full prefill's and
    both states draft the same speculative round."""
    dec = serve_decoder()
    bank = RoundBank.for_decoder(dec, switching=True)
    cfg, sp, key = dec.target.cfg, SamplingParams.make(), jax.random.key(0)
    batch = pad_prompts([PROMPTS[0], PROMPTS[2]], 8, cfg.vocab_size, cfg.max_position_embeddings,
                        slack=bank.max_slots)
    states, window = bank.model_states(), batch.tokens_bt.shape[1]        # one 64-token chunk fits
    lengths = batch.lengths_b.tolist()
    assert bank.lean_prefill(window, 1) and not bank.lean_prefill(window, 2)

    def prefill(tokens_bt, start, lengths_b, state, defer):
        nxt = np.zeros(len(lengths), np.int32)
        return bank.prefill_step(states, tokens_bt, nxt, np.int32(start), lengths_b, state, sp, key, greedy=True,
                                 defer=defer)[0]

    split = 4                       # resumed: the first 4 positions prefilled in full, the rest lean or not
    head = prefill(batch.tokens_bt[:, :split], 0, np.full(2, split, np.int32),
                   bank.new_state(2, batch.max_len, window), False)
    rest = np.zeros_like(batch.tokens_bt)
    rest[:, :window - split] = batch.tokens_bt[:, split:]
    for start, tokens, base in ((0, batch.tokens_bt, bank.new_state(2, batch.max_len, window)), (split, rest, head)):
        full = prefill(tokens, start, batch.lengths_b, jax.tree.map(jnp.copy, base), False)
        lean = prefill(tokens, start, batch.lengths_b, base, True)
        assert lean.deferred.lag_b.tolist() == [n - start for n in lengths]
        assert lean.tokens_bs is None and full.tokens_bs is None     # no round of this bank reads it
        for a, b in ((lean.lengths_b, full.lengths_b), (lean.pending_b, full.pending_b),
                     (lean.target_cache.kv.k_lbskd, full.target_cache.kv.k_lbskd)):
            assert np.allclose(a, b, atol=1e-6)
        assert not close(lean, full, lengths)         # the drafting caches wait
        caught = caught_up(bank, lean)
        assert caught.deferred.lag_b.tolist() == [0, 0] and close(caught, full, lengths)
        limits = batch.lengths_b + 8
        got = bank.run("dmtp", caught, np.ones(2, bool), limits, sp, key, 1, True)
        want = bank.run("dmtp", full, np.ones(2, bool), limits, sp, key, 1, True)
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])     # same drafts accepted


def caught_up(bank, state):
    """`catch_up` of `state` (jitted; the state is not donated)."""
    graphdefs = bank.setups["ar"].graphdefs
    return jax.jit(lambda s, st: catch_up(merge_models(graphdefs, s), st))(bank.model_states(), state)


def close(a, b, lengths) -> bool:
    """The MTP cache through the pending position, the context before it, the MTP hidden."""
    return all(np.allclose(x[:, row, :n + extra], y[:, row, :n + extra], atol=1e-5)
               for row, n in enumerate(lengths)
               for x, y, extra in ((a.mtp_cache.k_lbskd, b.mtp_cache.k_lbskd, 1),
                                   (a.mtp_cache.v_lbskd, b.mtp_cache.v_lbskd, 1),
                                   (a.ctx_cache.k_lbskd, b.ctx_cache.k_lbskd, 0),
                                   (a.ctx_cache.v_lbskd, b.ctx_cache.v_lbskd, 0))) \
        and np.allclose(a.mtp_h_bh, b.mtp_h_bh, atol=1e-5)


def test_no_round_copies_the_deferred_buffer():
    """The rounds write the buffer in place: XLA copies a donated buffer that a program reads in a loop
    and then writes (the catch-up is its own call for that), which would cost the whole buffer a round."""
    import re
    dec = serve_decoder()
    bank = RoundBank.for_decoder(dec, switching=True)
    state = bank.new_state(2, 128, defer_window=WINDOW)
    sp, key = SamplingParams.make(), jax.random.key(0)
    shapes = {str(tuple(x.shape)).replace(" ", "").strip("()") for x in jax.tree.leaves(state.deferred) if x.ndim > 1}
    for method in ("ar", "dmtp"):
        hlo = bank.round[method].lower(bank.model_states(), state, np.ones(2, bool), np.full(2, 100, np.int32), sp,
                                       key, np.int32(1), bank.knobs, greedy=True).compile().as_text()
        copied = [line for line in hlo.splitlines() if re.search(r"= \S+\[([0-9,]+)\]\S* copy\(", line)
                  and re.search(r"\[([0-9,]+)\]", line).group(1) in shapes]
        assert not copied, (method, copied[:2])
