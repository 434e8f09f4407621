"""The quick tier's list (tests/slow.txt) is read the way it is written."""

import doctest
import pathlib

from tests import tiers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiers_examples():
  result = doctest.testmod(tiers)
  assert result.attempted > 0 and result.failed == 0


def test_durations_are_summed_per_test():
  log = (
    "1.50s call     tests/a.py::t[x]\n"
    "0.50s setup    tests/a.py::t[x]\n"
    "4.00s call     tests/b.py::u\n"
    "noise 1.0s\n"
  )
  assert tiers.durations(log) == {"tests/a.py::t[x]": 2.0, "tests/b.py::u": 4.0}


def test_every_listed_module_exists():
  """A module renamed without regenerating the list would silently join
  the quick tier: its entries must name files that exist."""
  lines = (ROOT / "tests" / "slow.txt").read_text().splitlines()
  entries = [line for line in lines if line and not line.startswith("#")]
  assert entries
  for entry in entries:
    assert (ROOT / entry.split("::")[0]).is_file(), entry
