"""The demo's corpus and tokenizer: the Python standard library source of the running interpreter
(PSF licence, as are the tokenizer merges and prompts derived from it).

Training files: the stdlib's `*.py` files minus test directories, generated tables, files above
`MAX_FILE_BYTES` and the held-out modules `HELD_OUT` (benchmark prompts come from these), in a
fixed hash order up to `max_bytes`. The tokenizer is a byte-level BPE with `<|endoftext|>` (EOS /
PAD, id 0) and `<|mask|>` (DFlash mask, id 1), saved as an AutoTokenizer-loadable
`PreTrainedTokenizerFast`."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SKIP_DIRS = ("test", "tests", "idle_test", "__pycache__", "site-packages", "pydoc_data", "encodings")
MAX_FILE_BYTES = 150_000
# Held out of training (tokenizer and models): the benchmark prompts come from these.
HELD_OUT = (
    "bisect.py", "calendar.py", "colorsys.py", "difflib.py", "filecmp.py", "fileinput.py",
    "fnmatch.py", "fractions.py", "getopt.py", "gettext.py", "glob.py", "graphlib.py", "heapq.py",
    "ipaddress.py", "netrc.py", "numbers.py", "operator.py", "plistlib.py", "pprint.py", "queue.py",
    "reprlib.py", "sched.py", "secrets.py", "shlex.py", "statistics.py", "tabnanny.py",
    "textwrap.py", "uuid.py", "wave.py", "zipapp.py",
)


def stdlib_root() -> str:
    """The running interpreter's stdlib directory."""
    return sysconfig.get_paths()["stdlib"]


def _all_py_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(filenames) if f.endswith(".py")]
    return out


def _hash_key(rel: str) -> str:
    return hashlib.md5(rel.encode()).hexdigest()


def corpus_files(root: str | None = None, max_bytes: int = 4_000_000,
                 held_out: tuple[str, ...] = HELD_OUT) -> list[str]:
    """Relative paths of the training files, in their fixed order.

    Example:
        >>> files = corpus_files(max_bytes=100_000)
        >>> "textwrap.py" in files, sum(os.path.getsize(os.path.join(stdlib_root(), f)) for f in files) <= 100_000
        (False, True)
    """
    root = root or stdlib_root()
    chosen, total = [], 0
    for rel in sorted(_all_py_files(root), key=_hash_key):
        if rel in held_out:
            continue
        size = os.path.getsize(os.path.join(root, rel))
        if size > MAX_FILE_BYTES or size == 0 or total + size > max_bytes:
            continue
        chosen.append(rel)
        total += size
    return chosen


def held_out_files(root: str | None = None, held_out: tuple[str, ...] = HELD_OUT) -> list[str]:
    """The held-out modules present in this interpreter's stdlib."""
    root = root or stdlib_root()
    return [rel for rel in held_out if os.path.isfile(os.path.join(root, rel))]


def read_text(rel: str, root: str | None = None) -> str:
    """A stdlib file's text (UTF-8, undecodable bytes replaced)."""
    with open(os.path.join(root or stdlib_root(), rel), encoding="utf-8", errors="replace") as fh:
        return fh.read()


def train_tokenizer(texts, out_dir: str, vocab_size: int = 4096, min_frequency: int = 2) -> str:
    """Trains the byte-level BPE on `texts` and saves it (AutoTokenizer-loadable) to `out_dir`.

    Example:
        >>> d = train_tokenizer(["def f(x):\\n    return x\\n"] * 50, "/tmp/tok-doc", vocab_size=300)
        >>> from transformers import AutoTokenizer
        >>> tok = AutoTokenizer.from_pretrained(d)
        >>> tok.eos_token_id, tok.decode(tok("def f(x):").input_ids)
        (0, 'def f(x):')
    """
    from transformers import PreTrainedTokenizerFast     # lazy: transformers imports torch (seconds)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN)
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out_dir)
    return out_dir


def encode_files(tokenizer, texts, eos_id: int) -> np.ndarray:
    """One int32 token stream: each text's ids followed by EOS."""
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    parts = [np.asarray(ids + [eos_id], np.int32) for ids in enc]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def docstring_prompts(source: str, min_doc_chars: int = 40, max_chars: int = 600) -> list[str]:
    """Prompts cut from a module: each function's source from `def` through its docstring (and the
    newline after it), for docstrings of at least `min_doc_chars` characters.

    Example:
        >>> docstring_prompts("def f(a):\\n    \'\'\'Return a plus one, for every a given.\'\'\'\\n    return a\\n", 10)
        ["def f(a):\\n    \'\'\'Return a plus one, for every a given.\'\'\'\\n"]
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str) and len(first.value.value.strip()) >= min_doc_chars):
            continue
        start = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
        text = "".join(lines[start:first.end_lineno])
        indent = len(text) - len(text.lstrip(" "))
        text = "".join(line[indent:] if line.startswith(" " * indent) else line
                       for line in text.splitlines(keepends=True))
        if len(text) <= max_chars and len(first.value.value.strip()) >= min_doc_chars:
            out.append(text)
    return out


def build_prompts(files: list[str], num: int, seed: int = 0, root: str | None = None, **kw) -> list[str]:
    """`num` docstring prompts drawn (seeded, without replacement) from `files`, spread over them."""
    per_file = [docstring_prompts(read_text(f, root), **kw) for f in files]
    rng = np.random.default_rng(seed)
    for p in per_file:
        rng.shuffle(p)
    out, k = [], 0
    while len(out) < num and any(k < len(p) for p in per_file):   # round robin over the files
        out += [p[k] for p in per_file if k < len(p)]
        k += 1
    order = rng.permutation(len(out))[:num]
    return [out[i] for i in sorted(order)]


def write_prompt_jsonl(prompts: list[str], path: str) -> str:
    """`{"prompt": ...}` lines (the `infer.py bench --workload FILE.jsonl` layout); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")
    return path
