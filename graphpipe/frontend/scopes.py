"""Module-path names on traced equations.

Linen wraps every module call in a named scope, so the equations of a linen
model already carry their module path in `source_info.name_stack`. NNX does
not. `nnx_module_scopes` wraps the `__call__` of every NNX module class found
in a model in `jax.named_scope(MARK + path)` for the duration of a trace, and
restores the classes afterwards, also when the trace fails. The traced
copy's modules also carry their path as a static attribute: NNX's own
transforms (`nnx.remat`, `nnx.jit`) merge new module objects from the
graph definition, and the attribute comes with them where identity does
not.

`module_chain` reads a name stack back into the chain of module paths that
were active, outermost first, for either framework.
"""

import contextlib
import functools

import jax
from flax import nnx

from graphpipe.errors import CaptureError

# Marks the scopes this module adds, so user scopes inside NNX modules are
# not mistaken for module boundaries.
MARK = "gp:"
# The path attribute `nnx_module_scopes` sets on the modules it traces.
_PATH_ATTRIBUTE = "_graphpipe_path"


def path_to_str(path) -> str:
  """('blocks', 0, 'lin') -> 'blocks.0.lin'."""
  return ".".join(str(p) for p in path)


def _defining_class(cls):
  for klass in cls.__mro__:
    if "__call__" in klass.__dict__:
      return klass
  return None


@contextlib.contextmanager
def nnx_module_scopes(model: nnx.Module):
  """Names every NNX submodule call of `model` after its path while active.

  The root module gets no scope: equations of its own body are the model's
  glue code. Methods other than `__call__` are not wrapped; their equations
  belong to the module that calls them.

  Args:
    model: the (merged) model whose module instances are traced.
  """
  paths = {}
  for path, module in nnx.iter_modules(model):
    if path:
      paths[id(module)] = MARK + path_to_str(path)
      # NNX transforms (nnx.remat, nnx.jit, ...) split the modules they
      # are given and merge new objects inside; a static attribute is part
      # of the graph definition and survives that, where identity does
      # not (every rematerialised block was one 'glue' node).
      object.__setattr__(module, _PATH_ATTRIBUTE, paths[id(module)])
  classes = {}
  for _, module in nnx.iter_modules(model):
    klass = _defining_class(type(module))
    if klass is not None and klass not in classes:
      classes[klass] = klass.__dict__["__call__"]

  def wrap(original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
      name = paths.get(id(self), getattr(self, _PATH_ATTRIBUTE, None))
      if name is None:
        return original(self, *args, **kwargs)
      with jax.named_scope(name):
        return original(self, *args, **kwargs)

    return call

  try:
    for klass, original in classes.items():
      klass.__call__ = wrap(original)
    yield
  finally:
    for klass, original in classes.items():
      klass.__call__ = original


def module_chain(name_stack, framework: str) -> tuple[str, ...]:
  """The module paths active at an equation, outermost first.

  Args:
    name_stack: an equation's `source_info.name_stack`.
    framework: "nnx" (scopes added by `nnx_module_scopes`), "linen" (one
      scope per module, the first being the root module's class name) or
      "linen-relative" (inside a linen transform: no root name).

  Returns:
    e.g. ('blocks.0', 'blocks.0.lin'); () for the root module's own code and
    for code outside the model.
  """
  names = [s.name for s in name_stack.stack if type(s).__name__ == "Scope"]
  if framework == "nnx":
    chain = []
    for name in names:
      if name.startswith(MARK):
        path = name[len(MARK) :]
        if not chain or chain[-1] != path:
          chain.append(path)
    return tuple(chain)
  if framework in ("linen", "linen-relative"):
    # Inside a lifted transform (nn.remat, nn.jit) the stack starts afresh
    # at the transformed module: no root class name to drop.
    chain = []
    for name in names[1:] if framework == "linen" else names:
      chain.append(f"{chain[-1]}.{name}" if chain else name)
    return tuple(chain)
  raise CaptureError(
    f"unknown framework {framework!r}: module paths are read for 'nnx' or "
    "'linen' models"
  )
