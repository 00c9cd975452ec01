"""The README is a front page that stays true: at most 300 lines, starting with the two commands CI
runs; every `python infer.py ...` / `python train.py ...` command in a ```bash block of README.md or
docs/*.md is accepted by the real argument parser; every relative link of README.md and docs/*.md
points to a file that exists. No model is loaded: parsing only."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shlex

import pytest

import infer
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FIRST_COMMANDS = [
    "pip install -e . && python infer.py",
    'pip install -e ".[test]" && pip install --no-deps dflash==0.1.0 && python -m pytest -q',
]
PARSERS = {"infer.py": (infer.build_parser, infer.demo_argv), "train.py": (train.build_parser, None)}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
REDIRECTIONS = {">", ">>", "<", ">&", "&>"}


def bash_blocks(text: str) -> list[str]:
    """The bodies of the ```bash blocks of a Markdown text.

    Example:
        >>> bash_blocks("x\\n```bash\\necho 1\\n```\\n```\\nnot bash\\n```\\n")
        ['echo 1\\n']
    """
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def shell_commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block as argv lists: continuation lines joined, comments
    dropped, redirections (`> FILE`) dropped, split at `&&`, `;`, `|`, ...; shell variables become
    a dummy word.

    Example:
        >>> shell_commands('a --x $W && b "c d" > f  # note\\nfor w in 1 2; do e $w; done\\n')
        [['a', '--x', 'VALUE'], ['b', 'c d'], ['for', 'w', 'in', '1', '2'], ['do', 'e', 'VALUE'], ['done']]
    """
    text = re.sub(r"\$\{?[A-Za-z_][A-Za-z_0-9]*\}?", "VALUE", block.replace("\\\n", " "))
    commands = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        current: list[str] = []
        redirected = False
        for token in lexer:
            if redirected or token in REDIRECTIONS:      # `> FILE`: neither is an argument
                redirected = not redirected
            elif token in SHELL_OPERATORS:
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def cli_invocation(argv: list[str]) -> tuple[str, list[str]] | None:
    """(`infer.py` | `train.py`, its arguments) when `argv` runs one of the two CLIs with python
    (after `VAR=value` assignments and `do` / `then`), else None.

    Example:
        >>> cli_invocation(["PYTHONPATH=.", "python", "infer.py", "plan", "--target", "x"])
        ('infer.py', ['plan', '--target', 'x'])
        >>> cli_invocation(["python", "-m", "pytest"]) is None
        True
    """
    words = list(argv)
    while words and (re.match(r"^[A-Za-z_][A-Za-z_0-9]*=", words[0]) or words[0] in ("do", "then", "time")):
        words.pop(0)
    if len(words) >= 2 and words[0] in ("python", "python3") and words[1] in PARSERS:
        return words[1], words[2:]
    return None


def documented_invocations() -> list[tuple[str, str, list[str]]]:
    """(file, CLI, arguments) of every CLI command in the ```bash blocks of README and docs/."""
    found = []
    for path in [README, *DOCS]:
        with open(path) as fh:
            text = fh.read()
        for block in bash_blocks(text):
            for argv in shell_commands(block):
                invocation = cli_invocation(argv)
                if invocation is not None:
                    found.append((os.path.relpath(path, ROOT), *invocation))
    return found


def parse_error(cli: str, args: list[str]) -> str | None:
    """The parser's complaint about `args` (None when it accepts them), parsed as `main` would:
    infer.py's bare form is the demo benchmark, train.py's `--config FILE` names its subcommand."""
    build_parser, demo_argv = PARSERS[cli]
    if demo_argv is not None:
        args = demo_argv(args) or args
    else:
        args = train._config_command(args)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as stop:
        return err.getvalue().strip() or f"exit status {stop.code}"
    return None


def relative_links(text: str) -> list[str]:
    """The targets of a Markdown text's relative links and images (no scheme, no bare anchor),
    without their `#fragment`.

    Example:
        >>> relative_links("[a](docs/x.md#s) ![p](p.png) [w](https://x.org) [s](#top)")
        ['docs/x.md', 'p.png']
    """
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_a_front_page_that_starts_with_the_two_commands():
    with open(README) as fh:
        lines = fh.read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    body = [line for line in lines if line.strip()]
    assert body[0].startswith("# "), "README.md starts with its title"
    assert body[1:5] == ["```bash", *FIRST_COMMANDS, "```"], "the two commands come right after the title"


def test_every_documented_cli_command_parses():
    invocations = documented_invocations()
    documented = {(where, cli) for where, cli, _ in invocations}
    assert ("README.md", "infer.py") in documented and ("README.md", "train.py") in documented
    assert any(where == "docs/real-models.md" for where, _, _ in invocations)
    failures = [f"{where}: python {cli} {shlex.join(args)}\n    {error}"
                for where, cli, args in invocations if (error := parse_error(cli, args)) is not None]
    assert not failures, "commands the parsers refuse:\n" + "\n".join(failures)


def test_a_bad_command_is_caught():
    assert parse_error("infer.py", ["generate", "--no-such-flag"]) is not None
    assert parse_error("infer.py", ["--num-prompts", "two"]) is not None
    assert parse_error("train.py", ["plan", "--target", "x", "--seq-len", "N"]) is not None
    assert parse_error("infer.py", ["--num-prompts", "2", "--max-new-tokens", "16"]) is None


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_to_files_that_exist(path):
    with open(path) as fh:
        links = relative_links(fh.read())
    missing = [link for link in links if not os.path.exists(os.path.join(os.path.dirname(path), link))]
    assert not missing, f"{os.path.relpath(path, ROOT)} links to files that do not exist: {missing}"
