"""Out-of-domain prompts for the demo: function heads with their docstrings, cut from an installed
package that no demo model was trained or tuned on (the demo trained on the Python standard library).

    PYTHONPATH=. python benchmarks/ood_prompts.py --package tqdm --num 24 --out /tmp/ood.jsonl
    python infer.py bench --workload /tmp/ood.jsonl --methods dflash,dmtp,dmtp-adaptive --num-prompts 24

The prompts are cut at run time from the package as installed here (nothing is copied into the
repository); the same package version gives the same prompts (seeded draw, files in a fixed order).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from dmtp_jax.demo.corpus import _all_py_files, build_prompts, write_prompt_jsonl


def package_root(name: str) -> str:
    """The directory of an installed package (its `__init__.py`'s folder).

    Example:
        >>> os.path.isfile(os.path.join(package_root("json"), "__init__.py"))
        True
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: no installed package named {name!r}")
    return list(spec.submodule_search_locations)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", default="tqdm", help="installed package to cut prompts from (default tqdm)")
    p.add_argument("--num", type=int, default=24, help="prompts to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=600, help="longest prompt (characters)")
    p.add_argument("--out", required=True, help="JSONL to write ({\"prompt\": ...} per line)")
    args = p.parse_args(argv)
    root = package_root(args.package)
    files = [f for f in _all_py_files(root) if "test" not in f]
    prompts = build_prompts(files, args.num, seed=args.seed, root=root, max_chars=args.max_chars)
    if len(prompts) < args.num:
        print(f"warning: {args.package} gives only {len(prompts)} prompts", file=sys.stderr)
    write_prompt_jsonl(prompts, args.out)
    print(f"wrote {len(prompts)} prompts from {len(files)} files of {os.path.basename(root)} ({root}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
