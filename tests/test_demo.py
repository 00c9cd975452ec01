"""The shipped demo (`demo/`): it loads (in JAX and in transformers) and greedy speculative decoding
with its MTP heads (the target's distilled one and the corpus-only one), every drafter (EAGLE-3's
included) and prompt lookup reproduces plain decoding exactly."""

import json
import os

import numpy as np
import pytest

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")


@pytest.fixture(scope="module")
def demo_models():
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    from dmtp_jax.checkpoint.eagle3_ckpt import load_eagle3
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.tokenizer import load_tokenizer

    tdir = os.path.join(DEMO, "target")
    target = load_target(tdir, "float32")          # bf16 on disk, fp32 in memory
    mtp = load_mtp(tdir, target.cfg, "float32", target.mesh)
    dflash = load_drafter(os.path.join(DEMO, "dflash"), target.cfg, "float32", target.mesh)
    eagle3 = load_eagle3(os.path.join(DEMO, "eagle3"), target.cfg, "float32", target.mesh)
    out = {"target": target, "mtp": mtp, "dflash": dflash, "eagle3": eagle3, "tokenizer": load_tokenizer(tdir),
           "mtp_corpus": load_mtp(os.path.join(DEMO, "mtp_corpus"), target.cfg, "float32", target.mesh)}
    for name, method in (("dmtp", "dmtp"), ("dmtp_adaptive", "dmtp-adaptive"),
                         ("dmtp_adaptive_corpus", "dmtp-adaptive")):
        out[name] = load_dmtp_drafter(os.path.join(DEMO, name), target.cfg, method, "float32", target.mesh)
    return out


def _prompts(tokenizer, n=2):
    with open(os.path.join(DEMO, "prompts.jsonl")) as fh:
        texts = [json.loads(line)["prompt"] for line in fh if line.strip()][:n]
    return [tokenizer(t).input_ids for t in texts]


def test_greedy_speculative_methods_equal_ar(demo_models):
    from dmtp_jax.decode import make_decoder

    m = demo_models
    prompts = _prompts(m["tokenizer"])
    stops = [m["tokenizer"].eos_token_id]
    want = make_decoder("ar", m["target"]).generate(prompts, 24, stop_ids=stops).output_ids
    decoders = {
        "mtp": make_decoder("mtp", m["target"], mtp=m["mtp"]),
        "dflash": make_decoder("dflash", m["target"], m["dflash"]),
        "dmtp": make_decoder("dmtp", m["target"], m["dmtp"][0], mtp=m["mtp"], fusion=m["dmtp"][1]),
        "dmtp-adaptive": make_decoder("dmtp-adaptive", m["target"], m["dmtp_adaptive"][0], mtp=m["mtp"],
                                      fusion=m["dmtp_adaptive"][1]),
        "dmtp-adaptive, corpus-only MTP": make_decoder("dmtp-adaptive", m["target"], m["dmtp_adaptive_corpus"][0],
                                                       mtp=m["mtp_corpus"], fusion=m["dmtp_adaptive_corpus"][1]),
        "eagle3": make_decoder("eagle3", m["target"], m["eagle3"]),
        "lookup": make_decoder("lookup", m["target"]),
    }
    for name, dec in decoders.items():
        res = dec.generate(prompts, 24, stop_ids=stops)
        assert res.output_ids == want, name
        if name != "lookup":        # lookup has no trained model: it accepts only where the text repeats
            assert res.stats["per_verify_acceptance_length"] > 1.0, name     # trained drafters do accept


def test_transformers_loads_the_demo_target(demo_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import jax.numpy as jnp
    from flax import nnx

    tdir = os.path.join(DEMO, "target")
    tok = AutoTokenizer.from_pretrained(tdir)
    assert tok.eos_token_id == demo_models["target"].cfg.eos_token_ids[0]
    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    ids = tok("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    t = demo_models["target"]
    ours = nnx.merge(t.graphdef, t.state)
    x = jnp.asarray(ids.numpy())
    got = np.asarray(ours.logits(ours(x, jnp.arange(x.shape[1])[None]).hidden_bth))[0]
    assert np.abs(got - ref).max() < 1e-3
    assert (got.argmax(-1) == ref.argmax(-1)).all()
