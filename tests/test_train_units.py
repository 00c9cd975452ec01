"""Training building blocks: data records and iterator state, anchors, block inputs and loss
weights, the acceptance proxy, the CLI's error line, and the frozen target (zero gradient,
unchanged params)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_fixtures import tiny_train_config, write_random_data


def test_records_padding_and_malformed(caplog):
    from dmtp_jax.train.data import TokenDataset
    recs = ['{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}', "not json", '{"foo": 1}',
            '{"input_ids": [1, 2], "loss_mask": [1]}', '{"input_ids": [500]}', '{"text": "hi"}',
            '{"input_ids": [4, 5, 6, 7, 8, 9]}']
    ds = TokenDataset.from_records(recs, seq_len=4, vocab_size=128)
    toks, mask, bad = ds.encode(0)
    assert toks.tolist() == [1, 2, 3, 0] and mask.tolist() == [0, 1, 1, 0] and not bad
    for i in range(1, 6):                 # bad JSON, unknown layout, length mismatch, vocab, no tokenizer
        toks, mask, bad = ds.encode(i)
        assert bad and not mask.any()
    assert ds.malformed == 5 and "malformed record" in caplog.text
    assert ds.encode(6)[0].tolist() == [4, 5, 6, 7]       # truncated to seq_len


def test_batch_iterator_state_and_process_rows():
    from dmtp_jax.train.data import BatchIterator, TokenDataset
    ds = TokenDataset.from_records([json.dumps({"input_ids": [i + 1] * 3}) for i in range(5)], 4)
    it = BatchIterator(ds, 4, (0, 4), seed=1)
    it.next()
    state = it.get_state()
    json.dumps(state)                     # JSON-serialisable
    a = it.next()["tokens_bt"]
    it.set_state(state)
    np.testing.assert_array_equal(it.next()["tokens_bt"], a)
    half = BatchIterator(ds, 4, (2, 4), seed=1)           # rows 2..3 of the same global batches
    half.next()
    np.testing.assert_array_equal(half.next()["tokens_bt"], a[2:4])


def test_chat_messages_mask_assistant_turns(tmp_path):
    from transformers import AutoTokenizer
    from dmtp_jax.tiny import save_byte_tokenizer
    from dmtp_jax.train.data import encode_messages
    save_byte_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, mask = encode_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                 {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}], tok)
    supervised = tok.decode([t for t, m in zip(ids, mask) if m])
    assert supervised == "yo\nab\n"
    assert tok.decode(ids) == "<user>hi\n<assistant>yo\n<user>q\n<assistant>ab\n"


def test_anchors_respect_mask_and_block():
    from dmtp_jax.train.anchors import sample_anchors, valid_anchor_mask
    lm = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [0] * 12], jnp.int32)
    valid = valid_anchor_mask(lm, 4)
    for seed in range(5):
        a, keep = sample_anchors(jax.random.key(seed), lm, 6, 4)
        assert a.shape == (2, 6)
        kept = np.asarray(a)[0][np.asarray(keep)[0]]
        assert len(kept) == min(6, int(valid[0].sum())) and len(set(kept)) == len(kept)
        assert all(valid[0, i] for i in kept) and list(kept) == sorted(kept)
        assert not keep[1].any() and not a[1].any()


def test_block_inputs_labels_and_weights():
    from dmtp_jax.train.loss import block_inputs
    toks = jnp.arange(10, 22)[None]
    lm = jnp.ones((1, 12), jnp.int32).at[0, 5].set(0)
    b = block_inputs("dflash", toks, lm, jnp.array([[2, 0]]), jnp.array([[True, False]]), 4,
                     mask_token_id=99, gamma=2.0)
    assert b.tokens_bnk.tolist() == [[[12, 99, 99, 99], [99, 99, 99, 99]]]
    assert b.labels_bnk[0, 0].tolist() == [12, 13, 14, 15]
    assert b.positions_bnk[0, 0].tolist() == [2, 3, 4, 5]
    w = np.asarray(b.weights_bnk[0])
    np.testing.assert_allclose(w[0], [0, 1, np.exp(-0.5), 0], rtol=1e-6)   # slot 3 unsupervised
    assert not w[1].any()
    # dmtp: [A, T1, MASK, MASK] at a..a+3, T1 from the data, loss from the third row on
    d = block_inputs("dmtp", toks, jnp.ones((1, 12), jnp.int32), jnp.array([[2]]), jnp.array([[True]]), 4,
                     mask_token_id=99, gamma=None)
    assert d.tokens_bnk.tolist() == [[[12, 13, 99, 99]]] and d.weights_bnk.tolist() == [[[0, 0, 1, 1]]]
    # single anchor: [T1, MASK, MASK] at a+1..a+3
    s1 = block_inputs("dmtp-single", toks, jnp.ones((1, 12), jnp.int32), jnp.array([[2]]), jnp.array([[True]]),
                      4, mask_token_id=99, gamma=None)
    assert s1.tokens_bnk.tolist() == [[[13, 99, 99]]] and s1.positions_bnk.tolist() == [[[3, 4, 5]]]
    assert s1.labels_bnk.tolist() == [[[13, 14, 15]]] and s1.weights_bnk.tolist() == [[[0, 1, 1]]]
    with pytest.raises(ValueError, match="unknown training method"):
        block_inputs("eagle", toks, lm, None, None, 4, mask_token_id=99, gamma=2.0)


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    import train
    assert train.main(["train", "--target", str(tmp_path), "--data", "x.jsonl", "--out", str(tmp_path / "o"),
                       "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --steps")
    assert train.main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "e")]) == 2
    assert "not a training run" in capsys.readouterr().err


@pytest.mark.parametrize("method,target_fixture", [("dflash", "tiny_qwen3_dir"), ("dmtp", "mtp_target_dir"),
                                                   pytest.param("dmtp-ctx-fusion", "mtp_target_dir",
                                                                marks=pytest.mark.heavy)])
def test_target_and_mtp_are_frozen(method, target_fixture, request, tmp_path):
    """Gradients w.r.t. the target (and, for DMTP, the MTP head) are exactly zero and their params
    never change; the drafter (and the zero-initialised fusion) do train."""
    from dmtp_jax.train.run import setup
    from dmtp_jax.train.step import loss_sums
    target_dir = request.getfixturevalue(target_fixture)
    data = write_random_data(str(tmp_path / "d.jsonl"), n=4, length=32)
    cfg = tiny_train_config(target_dir, data, str(tmp_path / "r"), batch_size=2, seq_len=32, method=method)
    target, params, trainer, batches = setup(cfg)
    mtp = trainer.mtp
    frozen = (target.state, mtp.state if mtp else None)
    before = [np.array(x) for x in jax.tree.leaves(frozen)]
    state = trainer.init_state(params)
    batch = batches.next()

    def loss(frozen_states):
        t_state, m_state = frozen_states
        return loss_sums(state.params, trainer.graphdefs, target.graphdef, t_state, mtp.graphdef if mtp else None,
                         m_state, batch["tokens_bt"], batch["loss_mask_bt"], jax.random.key(0), trainer.scfg,
                         jnp.float32)[0]
    grads = jax.jit(jax.grad(loss))(frozen)
    assert jax.tree.leaves(grads) and all(not np.asarray(g).any() for g in jax.tree.leaves(grads))
    start = jax.tree.map(np.array, state.params)
    for _ in range(2):
        state, m = trainer.step(state, batch)
    assert float(m["loss"]) > 0
    for a, b in zip(before, jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for name in state.params:     # every trainable part moved (the fusion from its zero init)
        moved = [np.abs(np.asarray(b) - a).max() for a, b in zip(jax.tree.leaves(start[name]),
                                                                 jax.tree.leaves(state.params[name]))]
        assert max(moved) > 0, name


def test_trainer_evaluate_pools_the_loss_without_updating(tiny_qwen3_dir, tmp_path):
    """`Trainer.evaluate` (the trainer interface's held-out metrics): the weighted CE pooled over
    the batches, anchors from `key(seed)`, params untouched."""
    from dmtp_jax.train.run import setup
    from dmtp_jax.train.step import loss_sums
    data = write_random_data(str(tmp_path / "d.jsonl"), n=4, length=32)
    cfg = tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "r"), batch_size=2, seq_len=32)
    target, params, trainer, batches = setup(cfg)
    state = trainer.init_state(params)
    evals = [batches.next(), batches.next()]
    before = jax.tree.map(np.array, state.params)
    got = trainer.evaluate(state.params, evals)
    reference = jax.jit(lambda params, t_state, tokens_bt, loss_mask_bt: loss_sums(   # one compile, not op by op
        params, trainer.graphdefs, target.graphdef, t_state, None, None, tokens_bt, loss_mask_bt,
        jax.random.key(cfg.seed), trainer.scfg, jnp.float32)[1])
    sums = [jax.device_get(reference(state.params, target.state, b["tokens_bt"], b["loss_mask_bt"])) for b in evals]
    want = sum(float(s["loss_sum"]) for s in sums) / sum(float(s["weight_sum"]) for s in sums)
    assert got["loss"] == pytest.approx(want, rel=1e-5) and 0 <= got["acc"] <= 1 and got["accept_len_proxy"] >= 1
    assert trainer.evaluate(state.params, evals) == got
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
