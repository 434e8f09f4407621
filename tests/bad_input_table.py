"""The two tests every bad-input table runs (graphpipe's and disco's)."""

import pytest


def table_tests(rows):
  """Tests for `rows` of (id, case(ctx), error class, message pattern): each
  case raises its error with a matching message; ids are unique.

  Assign the result in a test module: `test_a, test_b = table_tests(ROWS)`.
  """

  @pytest.mark.parametrize(
    "case, error, pattern", [r[1:] for r in rows], ids=[r[0] for r in rows]
  )
  def test_bad_input_is_refused_clearly(ctx, case, error, pattern):
    with pytest.raises(error, match=pattern):
      case(ctx)

  def test_row_ids_are_unique():
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids))

  return test_bad_input_is_refused_clearly, test_row_ids_are_unique
