"""Loading pickles that may only hold plain data and numpy arrays.

`pickle.load` runs whatever callables a file names, so a pickle from an
untrusted folder can run code. `load` accepts only what the CIFAR-10 python
batch format holds: plain containers, strings, bytes, numbers and numpy
arrays. Any other global a file asks for is refused before it is imported.
"""

import importlib
import io
import pickle

from disco.errors import DataError

# The globals numpy arrays (and bytes written by Python 3 at protocol 2)
# are rebuilt with. numpy 2 renamed numpy.core to numpy._core.
_ALLOWED = {
  ("numpy", "ndarray"),
  ("numpy", "dtype"),
  ("numpy._core.multiarray", "_reconstruct"),
  ("numpy._core.multiarray", "scalar"),
  ("numpy._core.numeric", "_frombuffer"),
  ("_codecs", "encode"),
  # Python 3 at protocol 2 writes b"" (and an empty array's buffer) as
  # bytes() and a set as set([...]): plain data, rebuilt without code.
  ("builtins", "bytes"),
  ("builtins", "bytearray"),
  ("builtins", "set"),
  ("builtins", "frozenset"),
}


class _RestrictedUnpickler(pickle.Unpickler):
  def find_class(self, module, name):
    if module == "__builtin__":  # Python 2's name, kept by protocol 2
      module = "builtins"
    if module.startswith("numpy.core"):
      module = "numpy._core" + module[len("numpy.core") :]
    if (module, name) not in _ALLOWED:
      raise DataError(
        f"refusing to load {module}.{name} from a pickle: only plain "
        "containers, bytes and numpy arrays are accepted"
      )
    return getattr(importlib.import_module(module), name)

  def persistent_load(self, pid):
    raise DataError("refusing a pickle with persistent references")


def load(data: bytes, *, source: str = "pickle"):
  """Unpickles `data`, refusing anything but plain data and numpy arrays.

  Python 2 strings come back as bytes (the CIFAR-10 files were written by
  Python 2).

  Example:
    >>> import pickle
    >>> load(pickle.dumps({"labels": [1, 2]}, protocol=2))
    {'labels': [1, 2]}

  Args:
    data: the pickled bytes.
    source: names the data in error messages.

  Raises:
    DataError: the pickle asks for anything else, or is malformed.
  """
  try:
    return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
  except DataError as error:
    raise DataError(f"{source}: {error}") from None
  except Exception as error:  # any parse failure means a malformed file
    raise DataError(f"{source} is not a valid pickle: {error}") from None
