"""The paper model zoo (filled in by graphpipe/models/*.py)."""
