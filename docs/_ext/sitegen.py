"""What the site builds from the code, beyond autodoc.

- ``{flags} experiments.NAME``: a table of the experiment's absl flags
  (name, default, help), read by calling the module's ``define_flags()``
  and removing what it defined again, so the page is the code.
- A check of every dotted ``graphpipe.*``, ``disco.*`` or ``experiments.*``
  name written between backticks in any docstring of the three packages or in a
  page: it must import (a module) or be an attribute of one. A name that moved
  is a warning, and the build (``-W``) fails on it.
- A check that the API pages list every public name: each name of
  ``graphpipe.__all__`` and ``disco.__all__`` (and the public names of
  disco's public modules) must be documented somewhere on the site.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.util import logging

LOG = logging.getLogger(__name__)
ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("graphpipe", "disco", "experiments")
# `graphpipe.plan(...)`, `disco.prune.to_ratio`, `experiments.train`: a
# dotted name between backticks, possibly called or followed by ':'.
NAME = re.compile(
  r"`+(?:~|!)?((?:graphpipe|disco|experiments)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)"
)


def resolves(dotted: str) -> bool:
  """Whether `dotted` is a module, or an attribute path under a module."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    for attr in parts[cut:]:
      if hasattr(obj, attr):
        obj = getattr(obj, attr)
      elif attr in _fields(obj):
        obj = None  # a field of instances: nothing below it is checked
      else:
        return False
      if obj is None:
        return True
    return True
  return False


def _fields(obj) -> set[str]:
  """Names a class's instances have without the class having them."""
  found = set()
  for klass in getattr(obj, "__mro__", ()):
    found.update(getattr(klass, "__annotations__", {}))
    found.update(getattr(klass, "__dataclass_fields__", {}))
    found.update(getattr(klass, "_fields", ()))
  return found


def docstrings(path: pathlib.Path):
  """(line, text) of every docstring in the Python file at `path`."""
  tree = ast.parse(path.read_text())
  kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
  for node in ast.walk(tree):
    if isinstance(node, kinds):
      text = ast.get_docstring(node, clean=False)
      if text:
        yield (node.body[0].lineno, text)


def cited_names(text: str) -> list[str]:
  return [m.group(1).rstrip(".") for m in NAME.finditer(text)]


def _check(where: str, text: str) -> None:
  for name in cited_names(text):
    if not resolves(name):
      LOG.warning("%s cites `%s`, which does not resolve", where, name)


def _literal_blocks(app, what, name, obj, options, lines):
  """An experiment's module docstring is plain text: its indented runs
  (commands, file lists, formulas) become literal blocks, not quotes."""
  if what != "module" or not name.startswith("experiments."):
    return
  out = []
  inside = False
  for line in lines:
    indented = line.startswith(" ") and line.strip()
    if indented and not inside:
      if out and out[-1].strip():
        out.append("")
      out += ["::", ""]
      inside = True
    elif inside and line.strip() and not line.startswith(" "):
      out.append("")
      inside = False
    out.append(line)
  lines[:] = out


def _check_sources(app):
  """The names every docstring of the three packages cites resolve."""
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      for line, text in docstrings(path):
        _check(f"{path.relative_to(ROOT)}:{line}", text)
  for name in ("README.md", "BUILD.md"):
    _check(name, (ROOT / name).read_text())


def _on_source(app, docname, source):
  _check(f"page {docname}", source[0])


def experiment_flags(module_name: str) -> list[tuple[str, str, str]]:
  """(flag, default, help) of each flag `module_name` defines when run."""
  from absl import flags

  module = importlib.import_module(module_name)
  define = getattr(module, "define_flags", None) or module._define_flags
  before = set(flags.FLAGS)
  define()
  try:
    rows = []
    for flag in sorted(set(flags.FLAGS) - before):
      holder = flags.FLAGS[flag]
      default = holder.default_as_str or "(required)"
      rows.append((flag, default, holder.help or ""))
    return rows
  finally:
    for flag in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag)


class FlagsDirective(Directive):
  """``{flags} experiments.NAME``: the experiment's flags as a table."""

  required_arguments = 1

  def run(self):
    rows = experiment_flags(self.arguments[0])
    table = nodes.table(classes=["flags"])
    group = nodes.tgroup(cols=3)
    table += group
    for width in (20, 20, 60):
      group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    body = nodes.tbody()
    group += body

    def row(cells, literal):
      out = nodes.row()
      for i, cell in enumerate(cells):
        entry = nodes.entry()
        text = nodes.literal(text=cell) if literal[i] else nodes.Text(cell)
        entry += nodes.paragraph("", "", text)
        out += entry
      return out

    head += row(("flag", "default", "meaning"), (False, False, False))
    for flag, default, text in rows:
      body += row((f"--{flag}", default, text), (True, True, False))
    return [table]


def _check_api(app, env):
  """Every public name is documented somewhere on the site."""
  domain = env.get_domain("py")
  documented = set(domain.objects) | set(domain.modules)
  wanted = []
  for package in ("graphpipe", "disco"):
    module = importlib.import_module(package)
    for name in module.__all__:
      value = getattr(module, name)
      if getattr(value, "__name__", "").startswith(f"{package}."):
        wanted.append(value.__name__)  # a public module
      else:
        wanted.append(f"{package}.{name}")
  for name in sorted(wanted):
    if name not in documented:
      LOG.warning("public name %s is not in the API reference", name)


def setup(app):
  app.add_directive("flags", FlagsDirective)
  app.connect("builder-inited", _check_sources)
  app.connect("autodoc-process-docstring", _literal_blocks)
  app.connect("source-read", _on_source)
  app.connect("env-check-consistency", _check_api)
  return {"parallel_read_safe": False, "version": "1"}
