"""Where a named workload's records come from, first that works: `--data-dir DIR` or
`$DMTP_JAX_DATA` when set (that directory only); the hub through the optional `datasets` library
(`HUB_SOURCES`); `<repo>/../shared/data` if it holds the files. Else one `WorkloadError` saying
why the hub failed and which files a local directory must hold. Hub logging stays off stderr.

Example:
    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> (root / "gsm8k").mkdir()
    >>> _ = (root / "gsm8k" / "test.jsonl").write_text('{"question": "1 + 1?", "answer": "#### 2"}\\n')
    >>> records, source = named_records("gsm8k", ("gsm8k/test.jsonl",), data_dir=str(root))
    >>> records, source == f"{root}/gsm8k/test.jsonl"
    ([{'question': '1 + 1?', 'answer': '#### 2'}], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from pathlib import Path

from dmtp_jax.errors import DataError, WorkloadError
from dmtp_jax.train.data import MalformedRecord, parse_record, read_records

DATA_ENV = "DMTP_JAX_DATA"


@dataclasses.dataclass(frozen=True)
class HubSource:
    """`datasets.load_dataset(path, name, split=split, data_files=data_files)`."""
    path: str
    name: str | None = None
    split: str = "test"
    data_files: str | None = None

    @property
    def label(self) -> str:
        return f"hub:{self.data_files or self.path}"


# Rows of these datasets have the fields of the local files (`workloads.WORKLOADS` parses both).
HUB_SOURCES: dict[str, HubSource] = {
    "gsm8k": HubSource("openai/gsm8k", "main", "test"),
    "math500": HubSource("HuggingFaceH4/MATH-500", None, "test"),
    "humaneval": HubSource("openai/openai_humaneval", None, "test"),
    "mt_bench": HubSource("lighteval/mt-bench", None, "train"),
    "alpaca_eval": HubSource("json", None, "train", "hf://datasets/tatsu-lab/alpaca_eval/alpaca_eval.json"),
}


class HubUnavailable(Exception):
    """The hub could not serve a workload (the message says why)."""


def sibling_data_dir() -> str:
    """`<repo>/../shared/data` (the repo is the parent of `dmtp_jax/`)."""
    return str(Path(__file__).resolve().parents[2].parent / "shared" / "data")


@contextlib.contextmanager
def quiet_hub():
    """`datasets` / `huggingface_hub` logging at ERROR, no progress bars, no warnings, restored after."""
    import datasets     # optional (the `data` extra); callers checked it imports
    ds_logging = getattr(datasets, "logging", None)
    level = ds_logging.get_verbosity() if ds_logging else None
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    bars = getattr(datasets, "is_progress_bar_enabled", lambda: False)()
    try:
        if ds_logging:
            ds_logging.set_verbosity_error()
        hub_logger.setLevel(logging.ERROR)
        getattr(datasets, "disable_progress_bars", lambda: None)()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if ds_logging:
            ds_logging.set_verbosity(level)
        hub_logger.setLevel(hub_level)
        if bars:
            getattr(datasets, "enable_progress_bars", lambda: None)()


def hub_records(source: HubSource) -> list[dict]:
    """The rows of a hub dataset as dicts; `HubUnavailable` (with the reason) when `datasets` is missing
    or the hub does not answer."""
    try:
        import datasets     # optional: the `data` extra
    except ImportError:
        raise HubUnavailable("the `datasets` library is not installed") from None
    with quiet_hub():
        try:
            rows = datasets.load_dataset(source.path, source.name, split=source.split, data_files=source.data_files)
        except Exception as e:     # noqa: BLE001 -- offline, not found, rate-limited...: all mean "use local"
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            raise HubUnavailable(f"{source.data_files or source.path}: {type(e).__name__}: {first}") from None
    return [dict(row) for row in rows]


def local_records(name: str, files, root: str, how: str) -> tuple[list[dict], str]:
    """Records of `files` under `root` (`train.data.read_records`), concatenated, and the paths read; a
    missing file or bad record is a `WorkloadError` saying which (and how `root` was chosen: `how`)."""
    paths = [os.path.join(root, f) for f in files]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise WorkloadError(f"workload '{name}' needs {missing[0]}, which does not exist ({how} is {root})",
                            hint=f"point --data-dir or {DATA_ENV} at a directory holding {', '.join(files)}")
    records = []
    for p in paths:
        try:
            raw = read_records(p)
        except DataError as e:
            raise WorkloadError(str(e)) from None
        for i, r in enumerate(raw, 1):
            try:
                records.append(parse_record(r))
            except MalformedRecord as e:
                raise WorkloadError(f"{p}: record {i}: {e}") from None
    return records, ",".join(paths)


def named_records(name: str, files, data_dir: str | None = None) -> tuple[list, str]:
    """`(records, source)` of a named workload, from the first place that has it.

    Example:
        >>> named_records("spec_bench", ("spec_bench/question.jsonl",), "/nowhere")
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.WorkloadError: workload 'spec_bench' needs /nowhere/spec_bench/question.jsonl, which does not exist (--data-dir is /nowhere)
    """
    if data_dir:
        return local_records(name, files, data_dir, "--data-dir")
    if os.environ.get(DATA_ENV):
        return local_records(name, files, os.environ[DATA_ENV], DATA_ENV)
    hub = HUB_SOURCES.get(name)
    try:
        if hub is None:
            raise HubUnavailable("it has no hub source here")
        return hub_records(hub), hub.label
    except HubUnavailable as e:
        problem = str(e)
    sibling = sibling_data_dir()
    if all(os.path.isfile(os.path.join(sibling, f)) for f in files):
        return local_records(name, files, sibling, "the checkout's shared data")
    install = " (pip install 'dmtp-jax[data]' for the hub)" if "not installed" in problem else ""
    raise WorkloadError(f"workload '{name}' could not be loaded: not from the hub ({problem}) and no local "
                        f"directory is set (--data-dir / {DATA_ENV})",
                        hint=f"pass --data-dir DIR with {', '.join(files)} under DIR{install}")
