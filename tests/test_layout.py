"""The package layout's dependency rules, checked by parsing every import (lazy ones too).

  allocator core (jax_kvalloc/*.py)  may import pallas_kernels; never the class layer
                                     (jax_kvalloc.sglang), the tooling (jax_kvalloc.tools,
                                     jax_kvalloc.serve), torch_ref, torch or triton
  class layer (jax_kvalloc.sglang)   may import the core and pallas_kernels; never the
                                     tooling, torch_ref, torch or triton
  sglang-jax flavour                 the class layer on top of jax_kvalloc.sglang: may
    (jax_kvalloc.sgl_jax)            import it, the core and pallas_kernels; never the
                                     tooling, torch_ref, torch or triton (nor the reverse)
  pallas_kernels                     imports nothing of ours (kernels in, arrays out)
  torch_ref                          imports nothing of ours (an independent reference)
  jax_kvalloc.tools                  may import all three
  jax_kvalloc.serve (the engine)     tooling too: may import the core; nothing else imports it
No shipped module imports a test helper (tests/*.py).
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_HELPERS = {p.stem for p in (ROOT / "tests").glob("*.py")}


def imported_modules(source: str, module: str) -> set:
  """Absolute names of every module `source` imports (relative imports resolved against
  the dotted `module` name), wherever the import statement stands."""
  names = set()
  package = module.rsplit(".", 1)[0]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
  return names


def _forbidden(module: str):
  """(forbidden prefixes, rule name) for a module of ours."""
  ours = ("jax_kvalloc", "pallas_kernels", "torch_ref")
  if module.startswith(("jax_kvalloc.tools", "jax_kvalloc.serve")) or (
      module == "jax_kvalloc.__main__"):
    return (), "tooling"
  if module.startswith("jax_kvalloc.sgl_jax"):
    return ("jax_kvalloc.tools", "jax_kvalloc.serve", "torch_ref", "torch", "triton"), (
        "sglang-jax flavour")
  if module.startswith("jax_kvalloc.sglang"):
    return ("jax_kvalloc.sgl_jax", "jax_kvalloc.tools", "jax_kvalloc.serve", "torch_ref", "torch", "triton"), (
        "class layer")
  if module.startswith("jax_kvalloc"):
    return ("jax_kvalloc.sglang", "jax_kvalloc.sgl_jax", "jax_kvalloc.tools",
            "jax_kvalloc.serve", "torch_ref", "torch", "triton"), "allocator core"
  if module.startswith("pallas_kernels"):
    return tuple(o for o in ours if o != "pallas_kernels") + ("torch", "triton"), "pallas_kernels"
  if module.startswith("torch_ref"):
    return tuple(o for o in ours if o != "torch_ref"), "torch_ref"
  raise AssertionError(module)


def violations(module: str, source: str) -> list:
  banned, rule = _forbidden(module)
  out = []
  for name in sorted(imported_modules(source, module)):
    top = name.split(".")[0]
    if any(name == b or name.startswith(b + ".") for b in banned):
      out.append(f"{module} ({rule}) imports {name}")
    elif top in TEST_HELPERS and top not in ("jax_kvalloc", "pallas_kernels", "torch_ref"):
      out.append(f"{module} imports the test helper {name}")
  return out


def _modules():
  for pkg in ("jax_kvalloc", "pallas_kernels", "torch_ref"):
    for path in sorted((ROOT / pkg).rglob("*.py")):
      rel = path.relative_to(ROOT).with_suffix("")
      parts = list(rel.parts)
      if parts[-1] == "__init__":
        parts = parts[:-1] + ["__init__"]
      yield ".".join(parts), path


def test_import_rules_hold():
  found = [v for module, path in _modules() for v in violations(module, path.read_text())]
  assert not found, "\n".join(found)


def test_every_package_has_modules():
  names = {m for m, _ in _modules()}
  for expected in ("jax_kvalloc.allocation", "jax_kvalloc.tools.cli", "pallas_kernels.triton_extend",
                   "torch_ref.paged", "jax_kvalloc.sglang.paged",
                   "jax_kvalloc.sglang.backends.device", "jax_kvalloc.serve.engine"):
    assert expected in names


@pytest.mark.parametrize("module,source", [
    ("jax_kvalloc.allocation", "def f():\n  from jax_kvalloc.tools import traces\n"),
    ("jax_kvalloc.sglang.base", "import torch_ref\n"),
    ("jax_kvalloc.state", "from .tools import bench\n"),
    ("jax_kvalloc.allocation", "from jax_kvalloc.sglang import paged\n"),
    ("jax_kvalloc.__init__", "from jax_kvalloc.sglang import TokenToKVPoolAllocator\n"),
    ("jax_kvalloc.ranks", "def f():\n  import jax_kvalloc.sglang.base\n"),
    ("jax_kvalloc.request_table", "from jax_kvalloc.serve import engine\n"),
    ("jax_kvalloc.sglang.paged", "from jax_kvalloc.tools import traces\n"),
    ("pallas_kernels.triton_extend", "import jax_kvalloc as kv\n"),
    ("pallas_kernels._util", "from kernel_cases import cdiv\n"),
    ("torch_ref.paged", "from jax_kvalloc.tools import traces\n"),
])
def test_checker_catches_a_violation(module, source):
  assert violations(module, source), (module, source)


def test_checker_allows_the_tooling_and_plain_imports():
  assert not violations("jax_kvalloc.tools.parity", "import torch_ref\nimport jax_kvalloc\n")
  assert not violations("jax_kvalloc.allocation", "import jax\nfrom jax_kvalloc import state\n"
                        "import pallas_kernels\n")
  assert not violations("jax_kvalloc.sglang.base", "from jax_kvalloc import freeing\n"
                        "from jax_kvalloc.sglang.backends import device\n")
