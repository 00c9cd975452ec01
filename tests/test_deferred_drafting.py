"""Deferred drafting caches (`decode/drafting.py`): the plain rounds of a switching bank buffer their
rows, a full buffer catches up inside a plain round, and `catch_up` leaves the MTP cache, the MTP
hidden and the drafter's context as advancing them every round does (the tiny dmtp models of
tests/serve_fixtures.py, fp32)."""

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
ROUNDS = WINDOW + 20            # row 0 fills its buffer once (a two-block catch-up inside a plain round),
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
        deferred = bank.prefill_step(states, chunk_bt, next_b, start, batch.lengths_b, deferred, sp, key, greedy=True)
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

    def close(a, b):
        """The MTP cache through the pending position, the context before it, the MTP hidden."""
        return all(np.allclose(x[:, row, :n + extra], y[:, row, :n + extra], atol=1e-5)
                   for row, n in enumerate(lengths)
                   for x, y, extra in ((a.mtp_cache.k_lbskd, b.mtp_cache.k_lbskd, 1),
                                       (a.mtp_cache.v_lbskd, b.mtp_cache.v_lbskd, 1),
                                       (a.ctx_cache.k_lbskd, b.ctx_cache.k_lbskd, 0),
                                       (a.ctx_cache.v_lbskd, b.ctx_cache.v_lbskd, 0))) \
            and np.allclose(a.mtp_h_bh, b.mtp_h_bh, atol=1e-5)

    assert not close(deferred, every)           # 20 and 2 rows wait
    graphdefs = bank.setups["ar"].graphdefs
    caught = jax.jit(lambda s, st: catch_up(merge_models(graphdefs, s), st))(states, deferred)
    assert caught.deferred.lag_b.tolist() == [0, 0]
    assert close(caught, every)
    again = jax.jit(lambda s, st: catch_up(merge_models(graphdefs, s), st))(states, caught)
    assert close(again, every)                  # nothing waits: nothing changes
