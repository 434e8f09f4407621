"""The documentation site builds with no warning, and its examples run.

The build is the one BUILD.md gives (`python -m sphinx -W --keep-going`):
a broken cross-reference, a docstring that does not parse, a public name
missing from the API pages or a cited `graphpipe.*` / `disco.*` /
`experiments.*` name that does not import fails it (`docs/_ext/sitegen.py`).
The pages' Python blocks run in order, one child process per page (as a
reader would paste them), and their `>>>` examples run through doctest.
"""

import doctest
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.child_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(
  p
  for p in DOCS.rglob("*.md")
  if "_build" not in p.parts and "_ext" not in p.parts
)


def _python_blocks(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow
def test_the_site_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-q",
      "-b",
      "html",
      "-d",
      str(tmp_path / "doctrees"),
      str(DOCS),
      str(tmp_path / "html"),
    ],
    cwd=ROOT,
    env=child_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-5000:]
  html = tmp_path / "html"
  pages = list(html.rglob("*.html"))
  assert len(pages) >= 15
  api = (html / "api" / "graphpipe.html").read_text()
  import graphpipe

  for name in graphpipe.__all__:
    assert f'id="graphpipe.{name}"' in api, name


@pytest.mark.slow
@pytest.mark.parametrize(
  "page",
  [p for p in PAGES if _python_blocks(p.read_text())],
  ids=lambda p: str(p.relative_to(DOCS)),
)
def test_page_python_blocks_run(page, tmp_path):
  code = "\n".join(_python_blocks(page.read_text()))
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    env=child_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize(
  "page",
  [p for p in PAGES if ">>>" in p.read_text()],
  ids=lambda p: str(p.relative_to(DOCS)),
)
def test_page_doctests_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  text = page.read_text()
  test = doctest.DocTestParser().get_doctest(
    text, {}, str(page.relative_to(DOCS)), str(page), 0
  )
  runner = doctest.DocTestRunner(
    optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  runner.run(test)
  assert runner.failures == 0
  assert runner.tries > 0


def test_no_page_sends_readers_to_build_md_and_it_stays_short():
  """BUILD.md is for building and running (the site shows it as its
  'Building and running' page); the other pages link each other."""
  for page in PAGES:
    if page.name == "building.md":
      assert "{include} ../BUILD.md" in page.read_text()
      continue
    text = page.read_text()
    assert "BUILD.md" not in text.replace("`BUILD.md`", ""), page
  assert os.path.getsize(ROOT / "BUILD.md") <= 25_000
