"""The layering rules of docs/design.md, checked on the source (no imports executed).

* ``te_jax/ops`` imports nothing from te_jax outside ``te_jax.ops``;
* no import cycle among te_jax modules (function-local imports count: they
  may not hide one);
* no module uses another module's private (``_``-prefixed) names, except a
  package's private submodules from inside that package;
* recipe classes are only told apart in their home (``recipe.py``,
  ``scaling.py``): no ``isinstance(..., DelayedScaling)`` or ``is_blockwise``
  branch anywhere else;
* the module layer reads the autocast context in one place, the core's
  settings reader (``te_jax.layers.settings``), which the Linen and NNX
  modules call once per call;
* the framework split: the core (``te_jax.layers``) imports no flax and
  nothing from ``te_jax.flax`` / ``te_jax.nnx``; ``te_jax.nnx`` imports
  nothing from ``te_jax.flax`` nor Linen (``flax.linen``), and ``te_jax.flax``
  nothing from ``te_jax.nnx``.

Each check is a function over a {module name: source} dict, so the tests
also run it on small made-up packages that break the rule (a check that can
never fail proves nothing).
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "te_jax")
RECIPE_HOME = {"te_jax.recipe", "te_jax.scaling"}
RECIPE_CLASSES = {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"}
CONTEXT_READERS = ("get_fp8_context", "in_fp8_autocast")
# Where the context may be read: the autocast itself, the package's lazy
# attribute hook, and the module layer's one reader (docs/design.md layer 4).
CONTEXT_MODULES = {"te_jax", "te_jax.autocast", "te_jax.layers.settings"}
# (package, imports its modules must not make): the framework split.
FRAMEWORK_RULES = (
    ("te_jax.layers", ("flax", "te_jax.flax", "te_jax.nnx")),
    ("te_jax.nnx", ("te_jax.flax", "flax.linen")),
    ("te_jax.flax", ("te_jax.nnx",)),
)
# The compiled CUDA custom calls (custom_calls/, layer 1): below the ops,
# imported by te_jax/ops/_native.py alone.
NATIVE_MODULE = "te_jax._te_jax_ffi"


def load_sources(root=ROOT, package="te_jax"):
  """{dotted module name: source text} of every .py file under ``root``."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for f in files:
      if not f.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
      if rel[-1] == "__init__":
        rel = rel[:-1]
      with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
        out[".".join([package] + rel)] = fh.read()
  return out


def _is_package(name, sources):
  return any(m.startswith(name + ".") for m in sources)


def _resolve(name, sources):
  """The module a dotted import name refers to (longest known prefix)."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    cand = ".".join(parts[:i])
    if cand in sources:
      return cand
  return None


def imports_of(module, sources):
  """[(imported module, private names used from it, line)] for one module,
  including function-local imports; ``from pkg import sub`` resolves to the
  submodule ``pkg.sub`` where it exists."""
  tree = ast.parse(sources[module])
  pkg = module if _is_package(module, sources) else module.rsplit(".", 1)[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        target = _resolve(a.name, sources)
        if target:
          out.append((target, [], node.lineno))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] +
                        ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        if full == NATIVE_MODULE:
          continue
        if full in sources:
          out.append((full, [], node.lineno))
        elif base in sources:
          private = [a.name] if a.name.startswith("_") else []
          out.append((base, private, node.lineno))
  return out


def _aliases(module, sources):
  """{local name: te_jax module} for ``import a.b as x`` / ``from a import b``."""
  tree = ast.parse(sources[module])
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in sources:
          out[a.asname or a.name] = full
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.asname and a.name in sources:
          out[a.asname] = a.name
  return out


def ops_violations(sources):
  """Imports from te_jax.ops modules of te_jax modules outside ops."""
  bad = []
  for m in sources:
    if m == "te_jax.ops" or m.startswith("te_jax.ops."):
      for target, _, line in imports_of(m, sources):
        if not (target == "te_jax.ops" or target.startswith("te_jax.ops.")):
          bad.append(f"{m}:{line} imports {target}")
  return bad


def find_cycle(sources):
  """One import cycle as a list of modules, or None. Edges from a module to
  the packages that contain it are implicit in Python and not counted."""
  graph = {m: sorted({t for t, _, _ in imports_of(m, sources) if t != m and
                      not m.startswith(t + ".")}) for m in sources}
  state, stack = {}, []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for t in graph.get(m, ()):
      if state.get(t) == 1:
        return stack[stack.index(t):] + [t]
      if t not in state:
        found = visit(t)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def private_name_uses(sources):
  """Uses of another module's ``_names``: imported, or as ``alias._name``."""
  bad = []
  for m in sources:
    pkg = m if _is_package(m, sources) else m.rsplit(".", 1)[0]
    for target, private, line in imports_of(m, sources):
      for name in private:
        if not f"{target}.{name}" in sources:
          bad.append(f"{m}:{line} imports {target}.{name}")
    aliases = _aliases(m, sources)
    for node in ast.walk(ast.parse(sources[m])):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        target = aliases[node.value.id]
        sub = f"{target}.{node.attr}"
        if not (sub in sources and sub.startswith(pkg + ".")):
          bad.append(f"{m}:{node.lineno} uses {target}.{node.attr}")
    for target, _, line in imports_of(m, sources):
      parent, _, last = target.rpartition(".")
      if last.startswith("_") and not (m == parent or m.startswith(parent + ".")):
        bad.append(f"{m}:{line} imports the private module {target}")
  return bad


def recipe_branches(sources):
  """``isinstance(x, <recipe class>)`` or ``.is_blockwise`` outside the recipe home."""
  bad = []
  for m, src in sources.items():
    if m in RECIPE_HOME:
      continue
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, ast.Attribute) and node.attr == "is_blockwise":
        bad.append(f"{m}:{node.lineno} reads is_blockwise")
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "isinstance" and len(node.args) == 2):
        names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                 for n in ast.walk(node.args[1])}
        if names & RECIPE_CLASSES:
          bad.append(f"{m}:{node.lineno} isinstance on {sorted(names & RECIPE_CLASSES)}")
  return bad


def context_readers(sources):
  """Modules other than :data:`CONTEXT_MODULES` that read the context."""
  bad = []
  for m, src in sources.items():
    if m in CONTEXT_MODULES:
      continue
    for node in ast.walk(ast.parse(src)):
      names = []
      if isinstance(node, ast.Name):
        names = [node.id]
      elif isinstance(node, ast.Attribute):
        names = [node.attr]
      elif isinstance(node, ast.ImportFrom):
        names = [a.name for a in node.names]
      for name in names:
        if name in CONTEXT_READERS:
          bad.append(f"{m}:{node.lineno} reads {name}")
  return bad


def imported_names(module, sources):
  """[(dotted name, line)] of every import of ``module`` (function-local ones
  too), te_jax's and others', as written: ``import a.b`` gives "a.b",
  ``from a import b`` "a.b" (relative imports resolved)."""
  pkg = module if _is_package(module, sources) else module.rsplit(".", 1)[0]
  out = []
  for node in ast.walk(ast.parse(sources[module])):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] +
                        ([base] if base else []))
      out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
  return out


def forbidden_imports(sources, rules=FRAMEWORK_RULES):
  """Imports that break the framework split (:data:`FRAMEWORK_RULES`)."""
  bad = []
  for m in sorted(sources):
    for pkg, forbidden in rules:
      if not (m == pkg or m.startswith(pkg + ".")):
        continue
      for name, line in imported_names(m, sources):
        if any(name == f or name.startswith(f + ".") for f in forbidden):
          bad.append(f"{m}:{line} imports {name}")
  return bad


# ---------------------------------------------------------------- the tree --

SOURCES = load_sources()


def test_sources_found():
  assert {"te_jax.ops.quantize", "te_jax.dense", "te_jax.scaling",
          "te_jax.flax.dense"} <= set(SOURCES)


def test_ops_import_only_ops():
  assert ops_violations(SOURCES) == []


def test_no_import_cycle():
  assert find_cycle(SOURCES) is None


def test_no_private_names_across_modules():
  assert private_name_uses(SOURCES) == []


def test_recipe_classes_only_told_apart_in_their_home():
  assert recipe_branches(SOURCES) == []


def test_only_the_settings_reader_reads_the_autocast():
  assert context_readers(SOURCES) == []


def test_core_is_framework_neutral_and_frameworks_are_apart():
  assert {"te_jax.layers.settings", "te_jax.layers.mlp", "te_jax.nnx.mlp",
          "te_jax.flax.mlp"} <= set(SOURCES)
  assert forbidden_imports(SOURCES) == []


# -------------------------------------------- the checks can fail at all --

def _pkg(**modules):
  return {k.replace("__", "."): v for k, v in modules.items()}


def test_checks_catch_made_up_violations():
  bad = _pkg(
      te_jax="",
      te_jax__ops="",
      te_jax__ops__quantize="from te_jax import recipe\n",
      te_jax__recipe="def f():\n  from te_jax import dense\n",
      te_jax__dense=("from te_jax import recipe\nfrom te_jax.recipe import _hidden\n"
                     "def g(r):\n  return isinstance(r, recipe.DelayedScaling) or "
                     "r.is_blockwise or recipe._other\n"),
      te_jax__layer="from te_jax.autocast import get_fp8_context\n",
  )
  assert ops_violations(bad) == ["te_jax.ops.quantize:1 imports te_jax.recipe"]
  cycle = find_cycle(bad)
  assert cycle is not None and set(cycle) == {"te_jax.recipe", "te_jax.dense"}
  private = private_name_uses(bad)
  assert "te_jax.dense:2 imports te_jax.recipe._hidden" in private
  assert "te_jax.dense:4 uses te_jax.recipe._other" in private
  branches = recipe_branches(bad)
  assert any("isinstance on ['DelayedScaling']" in b for b in branches)
  assert any("is_blockwise" in b for b in branches)
  assert context_readers(bad) == ["te_jax.layer:1 reads get_fp8_context"]


def test_native_module_is_imported_by_the_dispatcher_only():
  users = [m for m, src in SOURCES.items() if "import _te_jax_ffi" in src]
  assert users == ["te_jax.ops._native"]


def test_private_submodule_inside_its_package_is_allowed():
  ok = _pkg(te_jax="", te_jax__ops="", te_jax__ops___native="",
            te_jax__ops__gemm="from te_jax.ops import _native\nx = _native.dispatch\n")
  assert private_name_uses(ok) == []
  outside = dict(ok, **{"te_jax.dense": "from te_jax.ops import _native\n"})
  assert private_name_uses(outside) == [
      "te_jax.dense:1 imports the private module te_jax.ops._native"]


def test_framework_rules_catch_made_up_violations():
  bad = _pkg(
      te_jax="",
      te_jax__autocast="def get_fp8_context():\n  pass\n",
      te_jax__flax="",
      te_jax__flax__dense="import flax.linen as nn\nfrom te_jax.nnx import linear\n",
      te_jax__nnx="",
      te_jax__nnx__linear=("from flax import nnx\nfrom flax.core import meta\n"
                           "import flax.linen as nn\nfrom te_jax.flax.dense import unboxed\n"),
      te_jax__nnx__mlp="from .. import flax as tfx\n",
      te_jax__layers="",
      te_jax__layers__settings="from te_jax.autocast import get_fp8_context\n",
      te_jax__layers__gemm="import jax\ndef f():\n  from flax import nnx\n",
      te_jax__layers__mlp="from te_jax import nnx\nfrom te_jax.flax import fp8_module\n",
      te_jax__layers__norm="from te_jax import autocast\nx = autocast.get_fp8_context()\n",
  )
  assert forbidden_imports(bad) == [
      "te_jax.flax.dense:2 imports te_jax.nnx.linear",
      "te_jax.layers.gemm:3 imports flax.nnx",
      "te_jax.layers.mlp:1 imports te_jax.nnx",
      "te_jax.layers.mlp:2 imports te_jax.flax.fp8_module",
      "te_jax.nnx.linear:3 imports flax.linen",
      "te_jax.nnx.linear:4 imports te_jax.flax.dense.unboxed",
      "te_jax.nnx.mlp:1 imports te_jax.flax",
  ]
  assert context_readers(bad) == ["te_jax.layers.norm:2 reads get_fp8_context"]


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_library_modules_stay_under_500_lines(module):
  n = SOURCES[module].count("\n")
  assert n <= 500, f"{module} has {n} lines; split it (docs/design.md: modules under ~500 lines)"
