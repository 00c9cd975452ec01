"""The flag groups `infer.py`'s subcommands share: the drafting head, the speculative methods'
models and shape, serve's limits."""

from __future__ import annotations

DTYPES = ["float32", "bfloat16", "float16"]
DEFAULT_METHOD_HELP = ("with --draft, the drafter directory's own method (its dmtp_config, else dflash); "
                       "on the demo, dmtp; else ar")
API_KEY_ENV = "DMTP_JAX_API_KEY"


def draft_head_args(sp):
    """`--draft-head` and its shape (generate, bench, plan)."""
    from dmtp_jax.models.draft_head import DRAFT_HEADS
    sp.add_argument("--draft-head", default="full", choices=DRAFT_HEADS,
                    help="the drafting side's LM head (MTP's T1 and chain, the drafter's positions; verification "
                         "always uses the full head): full; efficient (a low-rank factor of the head, from its "
                         "truncated SVD at load time, shortlists candidates that are rescored exactly); or int8 "
                         "(the head quantized to int8 per vocabulary entry at load time)")
    sp.add_argument("--draft-head-rank", type=int, default=None, metavar="R",
                    help="efficient head: rank of the factor (default min(256, hidden/4))")
    sp.add_argument("--draft-head-shortlist", type=int, default=None, metavar="K",
                    help="efficient head: candidates rescored exactly (default min(1024, vocab/16))")
    sp.add_argument("--draft-head-vocab", type=int, default=None, metavar="N",
                    help="efficient head: score only the N most frequent tokens of the drafter's training data "
                         "(their counts: --draft-head-counts; default: the whole vocabulary)")
    sp.add_argument("--draft-head-factor", default=None, metavar="PATH",
                    help="efficient head (generate, bench, serve): a trained factor (`train.py head-factor`; a "
                         "drafter directory holding head_factor.safetensors, or the file) instead of the SVD; it "
                         "sets the rank and the subset (plan: give them as --draft-head-rank / --draft-head-vocab)")
    sp.add_argument("--draft-head-counts", default=None, metavar="PATH",
                    help="token counts for --draft-head-vocab: a .npy file or a directory holding token_counts.npy "
                         "(`train.py token-counts` writes it; default: the --draft directory, the demo's demo/dmtp)")


def method_args(sp, verify_list: bool = False):
    """The flags that choose the models and shape of the speculative methods (generate, bench);
    `verify_list`: `--verify` takes a comma-separated list (bench runs every verifier)."""
    from dmtp_jax.options import VERIFY_MODES
    sp.add_argument("--draft", help="DFlash / DFlash2 / DMTP drafter directory (dflash, dmtp*)")
    sp.add_argument("--eagle3", default=None, metavar="DIR",
                    help="EAGLE-3 drafter directory (eagle3; the LlamaForCausalLMEagle3 layout of SpecForge / "
                         "SGLang / vLLM, or `train.py export` of a --method eagle3 run)")
    sp.add_argument("--mtp", default=None, help="directory with the native MTP head (mtp, dmtp*; "
                                                "default: the target directory)")
    sp.add_argument("--mtp-steps", type=int, default=None, help="chain length of mtp (default 4: MTP415)")
    sp.add_argument("--block-size", type=int, default=None,
                    help="verify slots per round (default: the drafter's block_size)")
    sp.add_argument("--adaptive-threshold", type=float, default=None, metavar="P",
                    help="dmtp-adaptive: a row takes MTP's T1 when the MTP's top-1 probability is >= P "
                         "(0..1.01, 1.01: never; default: the drafter's calibrated threshold)")
    sp.add_argument("--rounds-per-dispatch", type=int, default=None, metavar="K",
                    help="speculative rounds per jitted call, rows stopping on device (default 1: the host syncs "
                         "after every round; serve: the most per call while nobody waits and K rounds take under "
                         "0.25 s, default 4); same outputs, streamed every K rounds")
    sp.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                    help="prefill prompts longer than N tokens in chunks of N (default 512): prefill memory "
                         "stays that of one chunk")
    verify_help = ("sampled verification: rejection (token-level rejection sampling with the proposers' "
                   "probabilities), block (block verification with the same probabilities: lossless, accepts "
                   "at least as much), or target-only (match target samples; what the paper measured). "
                   "Greedy is always exact match")
    if verify_list:
        sp.add_argument("--verify", default="rejection",
                        help=verify_help + ". A comma-separated list runs every speculative method once per "
                                           "verifier, side by side (e.g. rejection,target-only,block)")
    else:
        sp.add_argument("--verify", default="rejection", choices=VERIFY_MODES,
                        help=verify_help)
    draft_head_args(sp)
    sp.add_argument("--strict", action="store_true",
                    help="fail (instead of falling back to plain decoding) when the exactness probe finds "
                         "that a verify block differs from single-token decoding on this backend / dtype")


def server_limit_args(sp) -> None:
    """serve's limits and access flags (`dmtp_jax.serve.protocol.ServerLimits` holds the defaults)."""
    from dmtp_jax.serve.protocol import ServerLimits
    d = ServerLimits()
    sp.add_argument("--api-key", default=None,
                    help=f"require 'Authorization: Bearer KEY' on /v1/*, /metrics and every other path but "
                         f"/health (default: ${API_KEY_ENV}; unset: no key)")
    sp.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    sp.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                    help="largest request body in MiB; larger ones get 413 before they are parsed "
                         "(default %(default)s)")
    sp.add_argument("--max-waiting", type=int, default=d.max_waiting,
                    help="requests that may wait for a row; more get 429 (default %(default)s)")
    sp.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                    help="stop strings per request (default %(default)s)")
    sp.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                    help="characters per stop string (default %(default)s)")
    sp.add_argument("--max-top-k", type=int, default=256, metavar="K",
                    help="largest top_k a request may ask (the sampled round's top-k search width; any k up "
                         "to it compiles nothing; >= the vocabulary means off) (default %(default)s)")
    sp.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                    help="seconds a connection may take to send a whole request head (default %(default)s)")
    sp.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                    help="seconds a request may take to send its whole body after its head; slower ones get 408 "
                         "and their connection closed (default %(default)s)")
