"""The package's import order: every import inside `dmtp_jax/` (module level or in a function)
points to an earlier layer or within its own package, and no modules import each other in a
circle, not even through a package's `__init__`; no module is over 400 lines; nothing imports a
private JAX module (`jax._src`); docstrings stay under a fifth of the lines. Read from the source
(AST), nothing imported.

The layers, lowest first (a module may import its own layer's package and anything below):

    errors, paths, platform, counted_jit, methods -> hf_config -> config -> sharding -> layers -> models
    -> checkpoint, tokenizer -> options -> decode -> train -> tiny -> plan -> bench -> serve -> demo
    -> compare -> preflight -> cli -> commands

`infer.py`, `train.py`, `benchmarks/` and `tests/` sit above all of them."""

import ast
import collections
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dmtp_jax")
LAYERS = [("errors", "paths", "platform", "counted_jit", "methods"), ("hf_config",), ("config",), ("sharding",),
          ("layers",), ("models",), ("checkpoint", "tokenizer"), ("options",), ("decode",), ("train",), ("tiny",),
          ("plan",), ("bench",), ("serve",), ("demo",), ("compare",), ("preflight",), ("cli",),
          ("commands",)]
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


def imports(path: str, module_level: bool = False):
    """`(node, imported names)` of every import statement in the file at `path`: `import a.b` names
    `a.b`, `from a import b` names `a.b` (`b` may be a module or a name in `a`); `module_level`: only
    the imports run when the module is imported (none inside a function)."""
    tree = ast.parse(open(path).read(), path)
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and module_level:
            continue
        if isinstance(node, ast.Import):
            nodes.append((node, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            nodes.append((node, [f"{node.module}.{a.name}" for a in node.names]))
        todo.extend(ast.iter_child_nodes(node))
    return sorted(nodes, key=lambda n: n[0].lineno)


def import_edges(modules: dict[str, str], module_level: bool = False,
                 packages: bool = False) -> dict[tuple[str, str], int]:
    """`{(importer, imported module): line}` over `dmtp_jax` imports; `from pkg import submodule`
    counts as the submodule, and a module's own parent packages are not edges (Python imports them
    first anyway). `module_level`: only the imports run at import time; `packages`: `from pkg import
    name` also depends on `pkg/__init__`, the importer's own package included (its `__init__` may
    be what imported the importer)."""
    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name
    edges = {}
    for mod, path in modules.items():
        for node, names in imports(path, module_level):
            targets = [resolve(name) for name in names if name.startswith("dmtp_jax")]
            if packages and isinstance(node, ast.ImportFrom) and node.module in modules:
                targets.append(node.module)
            for target in targets:
                own_parent = mod.startswith(target + ".") and not (packages and target == getattr(node, "module", None))
                if target and target != mod and not own_parent:
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
    """No circle among the imports run at import time, a package's `__init__` counted as a module:
    `from pkg import x` inside a module that `pkg/__init__` imports (however indirectly) is one."""
    assert cycles({("a", "b"): 1, ("b", "c"): 1, ("c", "a"): 1, ("c", "d"): 1}) == [["a", "b", "c"]]
    found = cycles(import_edges(package_modules(), module_level=True, packages=True))
    assert not found, "modules that import each other in a circle:\n" + "\n".join(map(str, found))


def test_import_edges_count_a_package_init(tmp_path):
    sources = {"__init__": "from dmtp_jax.p.a import f\n", "a": "from dmtp_jax.p import b\n",
               "b": "def g():\n    from dmtp_jax.p import a\n"}
    modules = {}
    for name, text in sources.items():
        (tmp_path / f"{name}.py").write_text(text)
        modules["dmtp_jax.p" + ("" if name == "__init__" else f".{name}")] = str(tmp_path / f"{name}.py")
    at_import = import_edges(modules, module_level=True, packages=True)
    assert set(at_import) == {("dmtp_jax.p", "dmtp_jax.p.a"), ("dmtp_jax.p.a", "dmtp_jax.p"),
                              ("dmtp_jax.p.a", "dmtp_jax.p.b")}
    assert cycles(at_import) == [["dmtp_jax.p", "dmtp_jax.p.a"]]
    assert ("dmtp_jax.p.b", "dmtp_jax.p.a") in import_edges(modules, packages=True)
    assert ("dmtp_jax.p.a", "dmtp_jax.p") not in import_edges(modules)


MAX_LINES = 400


def test_no_long_modules():
    long = {os.path.relpath(path, os.path.dirname(ROOT)): n for path in package_modules().values()
            if (n := len(open(path).read().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_no_private_jax_imports():
    private = [f"{os.path.relpath(path, os.path.dirname(ROOT))}:{node.lineno}"
               for path in package_modules().values() for node, names in imports(path)
               if any(n == "jax._src" or n.startswith("jax._src.") for n in names)]
    assert not private, "imports of JAX's private modules (jax._src; they move between releases):\n" + "\n".join(private)


def docstring_lines(path: str) -> tuple[int, int]:
    """`(lines inside the module's, classes' and functions' docstrings, all lines)` of a file."""
    text = open(path).read()
    docs = 0
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs += first.end_lineno - first.lineno + 1
    return docs, len(text.splitlines())


MAX_DOCSTRING_SHARE = 0.20


def test_docstring_share():
    """Docstrings say what a function is for in a line or a few; a growing share means prose that
    belongs in docs/ (or nowhere)."""
    docs, lines = map(sum, zip(*(docstring_lines(p) for p in package_modules().values())))
    print(f"docstrings: {docs} of the library's {lines} lines ({docs / lines:.1%})")
    assert docs / lines < MAX_DOCSTRING_SHARE, f"docstrings are {docs / lines:.1%} of dmtp_jax's lines"
