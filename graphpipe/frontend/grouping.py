"""Labelled equations -> operator nodes, in four steps.

Only the loss's per-sample body is grouped (`loss_form`: the head that
combines its sums, the data statistics and parameter-only terms are
pieces of their own).

1. runs: maximal runs of consecutive body equations with the same label.
   Every run is an interval of a topologically ordered list, so the run
   graph is a DAG whatever the model does.
2. shared variables stay apart: a parameter read by several runs (a tied
   embedding, a bias every layer adds) is held by each reader's stage and
   its gradients summed across them (`graphpipe.runtime.shared`); a run
   outside every module that reads one is named after its module.
3. constants: a run of equations that read no input is copied into each
   run that reads it.
4. glue: a parameter-free run (concatenation, pooling, the loss's sum)
   joins its only successor, or else its only predecessor. Contracting an
   edge to a node's only successor (predecessor) cannot close a cycle.
"""

import jax

from graphpipe.frontend.scopes import module_chain


def _inner_chains(eqn, framework):
  for sub in jax.extend.core.jaxprs_in_params(eqn.params):
    for inner in sub.eqns:
      yield _eqn_chain(inner, framework)


def _eqn_chain(eqn, framework):
  """Module chain of an equation, looking inside nested jaxprs.

  A module called under `jax.jit` (or another transform) from its parent's
  code has its scope on the equations inside the nested jaxpr, not on the
  enclosing equation: the common chain of the inner equations then names it.
  """
  chain = module_chain(eqn.source_info.name_stack, framework)
  if framework != "nnx":
    # Linen scopes inside transforms are relative to the transformed
    # module (nn.remat(Block) named blk0: 'blk0/dense'); without them every
    # rematerialised block was one 'glue' node. Not under nn.jit: it
    # reuses one traced body, with the first call's names, for every call.
    if eqn.primitive.name in ("jit", "pjit"):
      return chain
    inner = _common(_inner_chains(eqn, "linen-relative"))
    if not inner:
      return chain
    return chain + tuple(f"{chain[-1]}.{c}" if chain else c for c in inner)
  common = _common(_inner_chains(eqn, framework))
  if not common:
    return chain
  if common[: len(chain)] == chain:  # inner stacks include the outer scopes
    return common if len(common) > len(chain) else chain
  if not chain or common[0].startswith(chain[-1] + "."):
    return chain + common  # inner stacks start afresh inside the transform
  return chain


def _common(chains):
  """The longest chain prefix all `chains` share (None for no chains)."""
  common = None
  for inner in chains:
    if common is None:
      common = inner
    else:
      k = 0
      while k < min(len(common), len(inner)) and common[k] == inner[k]:
        k += 1
      common = common[:k]
  return common


def labels_of(jaxpr, framework, depth):
  """Per top-level equation, its module path cut at `depth` ('' = glue)."""
  labels = []
  for eqn in jaxpr.eqns:
    chain = _eqn_chain(eqn, framework)
    labels.append(chain[min(depth, len(chain)) - 1] if chain else "")
  return labels


# Why a layer stack written as a scan stayed one node (`frontend.unroll`).
SCAN_REASON = (
  "its layers run inside one scan capture does not unroll (it unrolls a "
  "scan over stacked parameters without stacked outputs; this one has "
  "stacked outputs or scans other values, e.g. stacked random keys or "
  "running statistics): run those layers as a Python loop, or move what "
  "the scan returns per layer out of it"
)


def no_module_reason(jaxpr, framework) -> str:
  """Why no equation is labelled with a module, and what to do: module
  scopes appear only inside nested calls that span several modules (the
  whole forward under one jax.checkpoint, nnx.remat or jax.jit in
  loss_fn: capture cuts at top-level equations), or not at all."""
  nested = [
    eqn
    for eqn in jaxpr.eqns
    if any(chain for chain in _inner_chains(eqn, framework))
  ]
  if any(eqn.primitive.name == "scan" for eqn in nested):
    return SCAN_REASON[0].upper() + SCAN_REASON[1:]
  if nested:
    return (
      "Its modules run inside one transformed call (jax.checkpoint, "
      "nnx.remat or jax.jit around the whole model in loss_fn), which "
      "capture cannot cut: apply the transform inside each layer"
    )
  return (
    "Build the model from submodules (each layer an nnx.Module / linen "
    "Module called in __call__)"
  )


def runs(labels, indices):
  """[(label, equation indices)] of maximal runs of equal labels among
  the equations `indices` (in order)."""
  runs = []
  for i in indices:
    label = labels[i]
    if runs and runs[-1][0] == label:
      runs[-1][1].append(i)
    else:
      runs.append((label, [i]))
  return runs


def _node_deps(jaxpr, groups):
  owner = {}
  for n, g in enumerate(groups):
    for i in g:
      for v in jaxpr.eqns[i].outvars:
        owner[v] = n
  preds = [set() for _ in groups]
  for n, g in enumerate(groups):
    # A constant inlined into several nodes is defined in each of them.
    defined = {v for i in g for v in jaxpr.eqns[i].outvars}
    for i in g:
      for v in jaxpr.eqns[i].invars:
        if isinstance(v, jax.extend.core.Literal) or v in defined:
          continue
        m = owner.get(v)
        if m is not None and m != n:
          preds[n].add(m)
  return preds


def constant_equations(jaxpr) -> set[int]:
  """Equations that read no input of the loss (no parameter, variable or
  batch leaf), directly or through other equations: constants such as a
  causal mask or position indices built from literals."""
  inputs = set(jaxpr.invars)
  varying = set(inputs)
  constant = set()
  for i, eqn in enumerate(jaxpr.eqns):
    reads = [
      v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)
    ]
    if eqn.effects or any(v in varying for v in reads):
      varying.update(eqn.outvars)
    else:
      constant.add(i)
  return constant


def _reads(jaxpr, group, vars_):
  return {
    v
    for i in group
    for v in jaxpr.eqns[i].invars
    if not isinstance(v, jax.extend.core.Literal) and v in vars_
  }


class Grouping:
  """Mutable node sets during grouping: labels and equation indices."""

  def __init__(self, jaxpr, runs, model_vars):
    self.jaxpr = jaxpr
    self.labels = [label for label, _ in runs]
    self.groups = [list(g) for _, g in runs]
    self.model_vars = model_vars

  def name_by_variables(self, names: dict):
    """Runs outside every module that read model variables (a tied
    embedding's attend() called from the root) take the module path the
    variables share (`names`: variable -> its path)."""
    for n, group in enumerate(self.groups):
      if self.labels[n]:
        continue
      paths = sorted({names[v] for v in _reads(self.jaxpr, group, names)})
      if paths:
        modules = [p.split(".")[:-1] for p in paths]
        common = modules[0]
        for m in modules[1:]:
          k = 0
          while k < min(len(common), len(m)) and common[k] == m[k]:
            k += 1
          common = common[:k]
        self.labels[n] = ".".join(common)

  def has_model_vars(self, n):
    return bool(_reads(self.jaxpr, self.groups[n], self.model_vars))

  def merge(self, src, dst):
    self.groups[dst] = sorted(self.groups[dst] + self.groups[src])
    if not self.has_model_vars(dst) and self.labels[dst] == "":
      self.labels[dst] = self.labels[src]
    del self.groups[src]
    del self.labels[src]

  def inline_constants(self):
    """Copies every node made only of constant equations (`constant_
    equations`) into each node that reads it, and drops it.

    A causal mask or a position table built once in the root module and
    passed to every layer was a node with an edge to each of them, whose
    value has no batch axis: every cut between two layers crossed it and
    the trainer refused every pipeline. Each reader now builds its own
    copy (constants cost what building them costs, not a transfer).
    """
    constant = constant_equations(self.jaxpr)
    changed = True
    while changed:
      changed = False
      preds = _node_deps(self.jaxpr, self.groups)
      for n, group in enumerate(self.groups):
        if not all(i in constant for i in group):
          continue
        readers = [m for m, ps in enumerate(preds) if n in ps]
        if not readers:
          continue
        for m in readers:
          self.groups[m] = sorted(set(self.groups[m]) | set(group))
        del self.groups[n]
        del self.labels[n]
        changed = True
        break

  def absorb_glue(self):
    """Merges parameter-free runs into their only successor/predecessor."""
    changed = True
    while changed and len(self.groups) > 1:
      changed = False
      preds = _node_deps(self.jaxpr, self.groups)
      succs = [set() for _ in self.groups]
      for n, ps in enumerate(preds):
        for p in ps:
          succs[p].add(n)
      for n in range(len(self.groups)):
        if self.has_model_vars(n):
          continue
        if len(succs[n]) == 1:
          self.merge(n, next(iter(succs[n])))
        elif len(preds[n]) == 1:
          self.merge(n, next(iter(preds[n])))
        else:
          continue
        changed = True
        break

  def topological(self):
    """Orders node sets topologically, ties by first equation."""
    preds = _node_deps(self.jaxpr, self.groups)
    order, done = [], set()
    while len(order) < len(self.groups):
      ready = [
        n for n in range(len(self.groups)) if n not in done and preds[n] <= done
      ]
      n = min(ready, key=lambda k: min(self.groups[k]))
      order.append(n)
      done.add(n)
    self.groups = [sorted(self.groups[n]) for n in order]
    self.labels = [self.labels[n] for n in order]


def name_nodes(labels, groups, first_module_eqn, last_module_eqn):
  """Node names: module paths, 'input'/'glue'/'loss' for code outside."""
  names, seen = [], {}
  for label, group in zip(labels, groups, strict=True):
    if not label:
      if min(group) < first_module_eqn:
        label = "input"
      elif min(group) > last_module_eqn:
        label = "loss"
      else:
        label = "glue"
    count = seen.get(label, 0)
    seen[label] = count + 1
    names.append(label if count == 0 else f"{label}#{count}")
  return names
