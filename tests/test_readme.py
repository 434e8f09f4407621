"""The README's Python example runs as written."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_readme_example_runs(tmp_path):
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the example sets its own
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "samples/s" in out.stdout
