"""The serving tests' tiny models, built once per process (`functools.cache`) so that the engine
tests (tests/test_serve_engine.py) and the HTTP tests (tests/test_serve.py) share one decoder, its
engine round bank and their compiles: a tiny random Qwen3 target with an MTP head, a DFlash drafter
and a DMTP fusion, built in JAX (no torch); a few LM-head columns scaled up so drafts are partly
accepted."""

import functools

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17], [7, 7, 7]]
MAX_TOKENS = [20, 9, 30, 14, 25]
MAX_MODEL_LEN = 120     # cache 128 slots, as generate's: the prefill compile is shared


@functools.cache
def serve_decoder():
    """The dmtp decoder (block 4) on the tiny target."""
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


@functools.cache
def serve_reference() -> tuple:
    """`generate` of each prompt alone, greedy, no stop tokens."""
    dec = serve_decoder()
    return tuple(tuple(dec.generate([p], m, stop_ids=[]).output_ids[0]) for p, m in zip(PROMPTS, MAX_TOKENS))


@functools.cache
def serve_tokenizer():
    """A byte-level tokenizer (`tiny.save_byte_tokenizer`) in a temporary directory, loaded plain."""
    import tempfile

    from dmtp_jax.tiny import save_byte_tokenizer
    from dmtp_jax.tokenizer import load_tokenizer
    d = tempfile.mkdtemp(prefix="dmtp-serve-tok-")
    save_byte_tokenizer(d)
    return load_tokenizer(d, plain=True)


def chat_tokenizer(path: str, messages: list[dict]) -> tuple:
    """`(tokenizer, ids of messages)`: the byte-level tokenizer saved in `path`, loaded by transformers,
    with a small chat template."""
    from transformers import AutoTokenizer

    from dmtp_jax.tiny import save_byte_tokenizer
    save_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return tok, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def free_port() -> int:
    """A free local TCP port (for a server process a test starts)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout_s: float) -> None:
    """Waits until the server process `proc` answers `url/health` with 200; fails if it exits first
    (with its output, when piped) or `timeout_s` passes."""
    import time

    import httpx
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, (proc.returncode, proc.stdout.read() if proc.stdout else "")
        assert time.time() < deadline, "the server did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
