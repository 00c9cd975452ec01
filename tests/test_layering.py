"""The package's import order: every import inside `dmtp_jax/` (module level or in a function)
points to an earlier layer or within its own package, and no modules import each other in a
circle. Read from the source (AST), nothing imported.

The layers, lowest first (a module may import its own layer's package and anything below):

    errors, paths, platform, counted_jit, methods -> hf_config -> config -> sharding -> layers -> models
    -> checkpoint, tokenizer -> options -> decode -> train -> tiny -> plan -> bench -> serve -> demo
    -> compare -> preflight -> cli

`infer.py`, `train.py`, `benchmarks/` and `tests/` sit above all of them."""

import ast
import collections
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dmtp_jax")
LAYERS = [("errors", "paths", "platform", "counted_jit", "methods"), ("hf_config",), ("config",), ("sharding",),
          ("layers",), ("models",), ("checkpoint", "tokenizer"), ("options",), ("decode",), ("train",), ("tiny",),
          ("plan",), ("bench",), ("serve",), ("demo",), ("compare",), ("preflight",), ("cli",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def package_modules(root: str = ROOT) -> dict[str, str]:
    """`{dotted module name: path}` of every module under `root`."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = "dmtp_jax." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def import_edges(modules: dict[str, str]) -> dict[tuple[str, str], int]:
    """`{(importer, imported module): line}` over `dmtp_jax` imports; `from pkg import submodule`
    counts as the submodule, and a module's own parent packages are not edges (Python imports them
    first anyway)."""
    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name
    edges = {}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("dmtp_jax") else None
                if target and target != mod and not mod.startswith(target + "."):
                    edges.setdefault((mod, target), node.lineno)
    return edges


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "cli"


def test_every_import_points_down_the_layers():
    modules = package_modules()
    assert {layer(m) for m in modules if m != "dmtp_jax"} <= set(RANK), "a new top-level module needs a layer here"
    upward = [f"{a} -> {b} (line {line})" for (a, b), line in sorted(import_edges(modules).items())
              if a != "dmtp_jax" and layer(a) != layer(b) and RANK[layer(b)] >= RANK[layer(a)]]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph = collections.defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles({("a", "b"): 1, ("b", "c"): 1, ("c", "a"): 1, ("c", "d"): 1}) == [["a", "b", "c"]]
    found = cycles(import_edges(package_modules()))
    assert not found, "modules that import each other in a circle:\n" + "\n".join(map(str, found))
