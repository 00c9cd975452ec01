"""What the command-line tools (`infer.py`, `train.py`) share: argument types, an argparse parser
whose errors are one line, and the one place that turns a `dmtp_jax.errors.UserError` into one
`error:` (+ at most one `hint:`) line on stderr and exit status 2; any other exception is a bug and
keeps its traceback."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import importlib.util
import json
import os
import sys
from typing import Callable

from dmtp_jax.errors import InputError, UserError, format_user_error, one_line
from dmtp_jax.options import DraftHeadOptions, ModelSources
from dmtp_jax.paths import cache_root


def int_list(text: str) -> list[int]:
    """`"1, 2,3"` -> `[1, 2, 3]`; anything else is a one-line argparse error.

    Example:
        >>> int_list("1, 2,3")
        [1, 2, 3]
    """
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def port_number(text: str) -> int:
    """A TCP port in [0, 65535] (0: any free port); anything else is a one-line argparse error.

    Example:
        >>> port_number("8000")
        8000
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got '{text}'")
    return port


def draft_head_options(args: argparse.Namespace) -> DraftHeadOptions:
    """The `--draft-head*` flags as options (flags a command lacks: their defaults).

    Example:
        >>> draft_head_options(argparse.Namespace(draft_head="int8"))
        DraftHeadOptions(kind='int8', rank=None, shortlist=None, vocab=None, counts=None, factor=None)
    """
    return DraftHeadOptions(kind=getattr(args, "draft_head", "full"), rank=getattr(args, "draft_head_rank", None),
                            shortlist=getattr(args, "draft_head_shortlist", None),
                            vocab=getattr(args, "draft_head_vocab", None),
                            counts=getattr(args, "draft_head_counts", None),
                            factor=getattr(args, "draft_head_factor", None))


def model_sources(args: argparse.Namespace) -> ModelSources:
    """`--draft`, `--eagle3`, `--mtp`, `--dtype` and the drafting head as `ModelSources`.

    Example:
        >>> model_sources(argparse.Namespace(draft="d", dtype="bfloat16")).draft
        'd'
    """
    return ModelSources(draft=getattr(args, "draft", None), eagle3=getattr(args, "eagle3", None),
                        mtp=getattr(args, "mtp", None),
                        dtype=getattr(args, "dtype", "float32"), draft_head=draft_head_options(args))


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are `error: ...` and `hint: run '<prog> --help' ...`
    (two lines, exit status 2) instead of the whole usage; an unknown flag close to one of the
    subcommand's (`generate --max-tokens`) gets `hint: did you mean --max-new-tokens? ...`.
    Subparsers inherit the class."""

    def error(self, message: str, hint: str | None = None):
        hint = hint or f"run '{self.prog} --help' for the options"
        sys.stderr.write(f"error: {one_line(message)}\nhint: {hint}\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}", self.flag_hint(extras, namespace))
        return namespace

    def flag_hint(self, extras: list[str], namespace) -> str:
        """`did you mean --FLAG?` for the first unknown flag close to one of the chosen subcommand's,
        else where that subcommand's flags are listed."""
        parser = self
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                parser = action.choices.get(getattr(namespace, action.dest, None), parser)
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        for arg in extras:
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.8) if arg[:2] == "--" else []
            if close:
                return f"did you mean {close[0]}? (run '{parser.prog} --help' for the options)"
        return f"run '{parser.prog} --help' for the options"


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`handler(args)`; a `UserError` becomes its one-line message on stderr and exit status 2,
    Ctrl-C exit status 130. Every other exception propagates with its traceback."""
    try:
        return handler(args)
    except UserError as e:
        sys.stdout.flush()
        print(format_user_error(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("error: interrupted", file=sys.stderr)
        return 130


COMPILE_CACHE_ENV = "DMTP_JAX_COMPILE_CACHE"
COMPILE_CACHE_OFF = ("0", "off", "none", "false", "no")


def compile_cache_dir(flag: str | None = None) -> str | None:
    """Where JAX's persistent compilation cache lives: `--compile-cache` if given, else
    `$DMTP_JAX_COMPILE_CACHE`, else `$DMTP_JAX_CACHE/jax-cache` (`~/.cache/dmtp-jax/jax-cache`);
    None when the chosen value is `off` (or `0`, `none`).

    Example:
        >>> compile_cache_dir("off") is None, compile_cache_dir("/tmp/jc")
        (True, '/tmp/jc')
    """
    value = flag if flag is not None else os.environ.get(COMPILE_CACHE_ENV)
    if value is None or value == "":
        return os.path.join(cache_root(), "jax-cache")
    if value.strip().lower() in COMPILE_CACHE_OFF:
        return None
    return os.path.expanduser(value)


def add_compile_cache_arg(parser: argparse.ArgumentParser) -> None:
    """`--compile-cache DIR|off` (see `compile_cache_dir`)."""
    parser.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help=f"JAX's persistent compilation cache: compiled steps are reused across runs "
                             f"(default: ${COMPILE_CACHE_ENV}, else $DMTP_JAX_CACHE/jax-cache, i.e. "
                             f"~/.cache/dmtp-jax/jax-cache; 'off' disables it)")


def enable_compile_cache(flag: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache at `compile_cache_dir(flag)` for every compile,
    however short, or turns it off; returns the directory, or None when off. Only the CLI entry
    points call this: importing the library never writes a cache.

    Example:
        >>> enable_compile_cache("off") is None
        True
    """
    import jax     # lazy: the CLI's --help and argument errors do not import jax (seconds)
    from jax.experimental.compilation_cache import compilation_cache as cc     # lazy: as jax

    path = compile_cache_dir(flag)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            path = None                 # an unwritable cache is no reason to fail: compile as before
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cc.reset_cache()                    # a second in-process CLI call may move or disable it
    return path


def load_config_file(path: str) -> dict:
    """`get_config()` of a python file, as a dict (config files build on each other with it).

    Example:
        >>> repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        >>> load_config_file(os.path.join(repo, "configs", "demo_dflash.py"))["method"]
        'dflash'
    """
    spec = importlib.util.spec_from_file_location("_train_config", path)
    if spec is None or not path.endswith(".py"):
        raise InputError(f"--config must be a .py file with get_config(), got '{path}'")
    if not os.path.isfile(path):
        raise InputError(f"config file not found: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise InputError(f"{path} defines no get_config()")
    cfg = module.get_config()
    if dataclasses.is_dataclass(cfg):
        cfg = dataclasses.asdict(cfg)
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: get_config() must return a dict or a dataclass")
    return dict(cfg)


def add_plan_args(sp) -> None:
    """The flags `infer.py plan` and `train.py plan` share: the models' source, the machine, the
    mesh, the output."""
    sp.add_argument("--target", required=True, help="HF target directory or a config.json (configs/models/)")
    sp.add_argument("--topology", default="cpu:1",
                    help="the machine to compile for: a TPU slice as libtpu names it (v5p:2x2x2, v5p:4x4x4, v5e:4x4, "
                         "v6e:2x4; pip install -e '.[plan-tpu]'), a GPU host (h100x8, h200x8, b200x8; "
                         "pip install -e '.[plan-gpu]') or cpu:N (default cpu:1)")
    sp.add_argument("--mesh", default=None, help="mesh axes, e.g. tensor=8 or expert=4,tensor=2 (default: 1 device)")
    sp.add_argument("--hbm-gb", type=float, default=None, metavar="G",
                    help="memory per device in GiB (default: the topology's)")
    sp.add_argument("--json", dest="json_path", help="write the plan as JSON to this file")


def use_host_backend() -> None:
    """Compile-only runs (`plan`) never open an accelerator: JAX's own backend is the host CPU
    (the TPU / GPU targets are compile-only devices). A no-op once a backend has started."""
    import jax     # lazy: the CLI's --help and argument errors do not import jax (seconds)
    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:       # noqa: BLE001 -- a backend is already up (in-process callers, tests)
        pass


NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")     # dxg: WSL2
GOOGLE_PCI_VENDOR = "0x1ae0"
OTHER_PCI_CLASSES = ("0x01", "0x02", "0x06")     # storage, network, bridge: a cloud VM's disk and NIC


def visible_nvidia_gpu() -> bool:
    """Whether the kernel shows an NVIDIA GPU (its device files); starts no backend."""
    return any(os.path.exists(path) for path in NVIDIA_DEVICE_FILES)


def visible_tpu(pci_devices: str = "/sys/bus/pci/devices") -> bool:
    """Whether a Google PCI device other than a disk, a NIC or a bridge (a TPU chip) is present;
    starts no backend.

    Example:
        >>> visible_tpu("/does-not-exist")
        False
    """
    for device in glob.glob(os.path.join(pci_devices, "*")):
        try:
            with open(os.path.join(device, "vendor")) as vendor, open(os.path.join(device, "class")) as klass:
                if vendor.read().strip() == GOOGLE_PCI_VENDOR and not klass.read().startswith(OTHER_PCI_CLASSES):
                    return True
        except OSError:
            continue
    return False


def skip_absent_gpu_plugin() -> str | None:
    """On a machine without an NVIDIA GPU, the platforms become the host's (plus a visible TPU)
    unless `JAX_PLATFORMS` says otherwise, so an installed CUDA plugin skips its failing version
    check (it still registers: plan compiles for GPUs). Returns the platforms set, or None; a no-op
    once a backend has started.

    Example:
        >>> skip_absent_gpu_plugin() in (None, "cpu", "tpu,cpu")
        True
    """
    import jax     # lazy: the CLI's --help and argument errors do not import jax (seconds)
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return None
    if not any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13)
               if importlib.util.find_spec("jax_plugins") is not None):
        return None
    if visible_nvidia_gpu():
        return None
    platforms = "tpu,cpu" if visible_tpu() else "cpu"
    try:
        jax.config.update("jax_platforms", platforms)
    except Exception:       # noqa: BLE001 -- a backend is already up
        return None
    return platforms


def plan_progress(name: str) -> None:
    print(f"compiling {name} ...", file=sys.stderr, flush=True)


def finish_plan(plan, json_path: str | None) -> int:
    """Prints the plan, writes its JSON, and raises `DoesNotFitError` when it does not fit (after
    the table: the user sees what does not fit)."""
    from dmtp_jax.plan import DoesNotFitError, format_plan     # lazy: plan imports jax (seconds)

    print(format_plan(plan))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(plan.to_json(), fh, indent=2)
    if not plan.fits:
        raise DoesNotFitError(plan.misfit_message())
    return 0
