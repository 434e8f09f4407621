"""Timelines of a simulated iteration: Chrome/Perfetto trace JSON and Gantt.

The simulator records what each device does as `TraceEvent`s. `chrome_trace`
turns them into the Trace Event Format that https://ui.perfetto.dev and
chrome://tracing open: one process ("track") per device, with a lane for its
compute (forward, backward, gradient all-reduce, optimizer step) and one lane
per device it receives transfers from. `save_gantt` draws the same timeline
as a PNG with matplotlib, an optional extra imported only when called;
`draw_gantt` draws it on axes the caller made (a notebook's figure).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from graphpipe.errors import PlotsUnavailableError

COMPUTE_LANE = "compute"

# Colours by event category (matplotlib's tab10, so plots match the docs).
_COLOURS = {
  "forward": "#1f77b4",
  "backward": "#2ca02c",
  "allreduce": "#ff7f0e",
  "optimizer": "#7f7f7f",
  "transfer": "#9467bd",
}


@dataclasses.dataclass(frozen=True)
class TraceEvent:
  """One thing a device did, from `start_s` for `duration_s` seconds.

  Example:
    >>> TraceEvent("2F0", "forward", device=3, start_s=0.1, duration_s=0.02)
    TraceEvent(name='2F0', category='forward', device=3, start_s=0.1,
               duration_s=0.02, lane='compute', args={})

  Args:
    name: what ran, e.g. '2F0' or 'act 1F0 1->2'.
    category: 'forward', 'backward', 'transfer', 'allreduce' or 'optimizer'.
    device: the device whose track shows the event (the receiver for a
      transfer).
    start_s: start time in seconds from the start of the iteration.
    duration_s: length in seconds.
    lane: the lane of the device's track: 'compute' or, for transfers,
      'from dev K'.
    args: extra facts shown when the event is selected (bytes, stage, ...).
  """

  name: str
  category: str
  device: int
  start_s: float
  duration_s: float
  lane: str = COMPUTE_LANE
  args: dict[str, Any] = dataclasses.field(default_factory=dict)


def chrome_trace(
  events: Sequence[TraceEvent],
  track_names: Mapping[int, str] | None = None,
  metadata: Mapping[str, Any] | None = None,
) -> dict:
  """The events in Chrome's Trace Event Format (times in microseconds).

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> report = graphpipe.simulate(graphpipe.plan(graph, 4, 8), graph)
    >>> trace = chrome_trace(report.events, {0: "device 0 (stage 0)"})
    >>> trace["traceEvents"][0]         # names device 0's track
    {'name': 'process_name', 'ph': 'M', 'pid': 0, 'tid': 0,
     'args': {'name': 'device 0 (stage 0)'}}
    >>> with open("trace.json", "w") as f:   # open it in Perfetto
    ...   json.dump(trace, f)

  Args:
    events: the events to show.
    track_names: a display name per device; default 'device K'.
    metadata: free-form facts stored under 'otherData' (plan, figures).
  """
  track_names = dict(track_names or {})
  devices = sorted({e.device for e in events} | set(track_names))
  lanes = {d: [COMPUTE_LANE] for d in devices}
  for e in events:
    if e.lane not in lanes[e.device]:
      lanes[e.device].append(e.lane)
  out = []
  for device in devices:
    name = track_names.get(device, f"device {device}")
    out.append(_meta("process_name", device, 0, {"name": name}))
    out.append(_meta("process_sort_index", device, 0, {"sort_index": device}))
    for tid, lane in enumerate(lanes[device]):
      out.append(_meta("thread_name", device, tid, {"name": lane}))
      out.append(_meta("thread_sort_index", device, tid, {"sort_index": tid}))
  for e in events:
    out.append(
      {
        "name": e.name,
        "cat": e.category,
        "ph": "X",
        "ts": e.start_s * 1e6,
        "dur": e.duration_s * 1e6,
        "pid": e.device,
        "tid": lanes[e.device].index(e.lane),
        "args": dict(e.args),
      }
    )
  return {
    "traceEvents": out,
    "displayTimeUnit": "ms",
    "otherData": dict(metadata or {}),
  }


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
  return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def save_chrome_trace(
  path: str,
  events: Sequence[TraceEvent],
  track_names: Mapping[int, str] | None = None,
  metadata: Mapping[str, Any] | None = None,
) -> None:
  """Writes `chrome_trace(events, track_names, metadata)` as JSON to `path`.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> report = graphpipe.simulate(graphpipe.plan(graph, 4, 8), graph)
    >>> save_chrome_trace("trace.json", report.events)

  Args:
    path: the file to write.
    events, track_names, metadata: as for `chrome_trace`.
  """
  with open(path, "w") as f:
    json.dump(chrome_trace(events, track_names, metadata), f)


def save_gantt(
  path: str,
  events: Sequence[TraceEvent],
  track_names: Mapping[int, str] | None = None,
  title: str = "",
) -> None:
  """Draws the events as a Gantt chart (one row per device) into a PNG.

  The chart of `draw_gantt`, on a figure of its own. Needs matplotlib
  (`pip install matplotlib`, or the package's 'plots' extra); raises
  `PlotsUnavailableError` without it.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> report = graphpipe.simulate(graphpipe.plan(graph, 4, 8), graph)
    >>> save_gantt("schedule.png", report.events, title="two_branch, 4 GPUs")

  Args:
    path: the PNG file to write.
    events: the events to draw.
    track_names: a row label per device; default 'device K'.
    title: the chart title.
  """
  figure_cls, canvas_cls = _matplotlib()
  devices = {e.device for e in events} | set(track_names or {})
  figure = figure_cls(figsize=(12, 1 + 0.45 * max(len(devices), 1)))
  canvas_cls(figure)
  draw_gantt(figure.add_subplot(), events, track_names, title)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def draw_gantt(
  axes,
  events: Sequence[TraceEvent],
  track_names: Mapping[int, str] | None = None,
  title: str = "",
  end_s: float | None = None,
) -> None:
  """Draws the events as a Gantt chart on matplotlib `axes`.

  One row per device: compute events fill the row, labelled with their
  action when wide enough; transfers arriving at the device are thin bars
  along the row's bottom. Takes the caller's axes (and so imports no
  plotting library): several timelines can share a figure, and `end_s`
  gives them one time scale.

  Example:
    >>> from matplotlib.figure import Figure
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> report = graphpipe.simulate(graphpipe.plan(graph, 4, 8), graph)
    >>> axes = Figure().add_subplot()
    >>> draw_gantt(axes, report.events, report.track_names())
    >>> len(axes.get_yticks()) == len(report.track_names())
    True

  Args:
    axes: a matplotlib `Axes`.
    events: the events to draw.
    track_names: a row label per device; default 'device K'.
    title: the chart title.
    end_s: the right end of the time axis in seconds (default: the last
      event's end).
  """
  track_names = dict(track_names or {})
  devices = sorted({e.device for e in events} | set(track_names))
  row = {d: i for i, d in enumerate(devices)}
  end = max((e.start_s + e.duration_s for e in events), default=1.0) or 1.0
  end = end_s or end
  unit, scale = _time_unit(end)
  end *= scale
  for category, colour in _COLOURS.items():
    chosen = [e for e in events if e.category == category]
    if not chosen:
      continue
    thin = category == "transfer"
    for device in devices:
      spans = [
        (e.start_s * scale, e.duration_s * scale)
        for e in chosen
        if e.device == device
      ]
      if not spans:
        continue
      if thin:
        extent, style = (row[device] + 0.3, 0.1), {"alpha": 0.6}
      else:
        extent, style = (row[device] - 0.35, 0.6), {"edgecolors": "white"}
      axes.broken_barh(spans, extent, facecolors=colour, linewidth=0.3, **style)
    for e in chosen:
      # Labels only where they fit, so long runs stay readable.
      if not thin and e.duration_s * scale > end / 60:
        axes.text(
          (e.start_s + e.duration_s / 2) * scale,
          row[e.device],
          e.name,
          ha="center",
          va="center",
          fontsize=6,
          color="white",
        )
    axes.plot([], [], color=colour, linewidth=6, label=category)
  axes.set_yticks(range(len(devices)))
  axes.set_yticklabels([track_names.get(d, f"device {d}") for d in devices])
  axes.invert_yaxis()
  axes.set_xlim(0, end)
  axes.set_xlabel(f"time ({unit})")
  axes.set_title(title)
  axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _time_unit(seconds: float) -> tuple[str, float]:
  """A unit that shows `seconds` with a few digits, and its scale factor."""
  for unit, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
    if seconds * scale >= 1.0:
      return unit, scale
  return "ns", 1e9


def _matplotlib():
  """(Figure, FigureCanvasAgg), imported now: plotting is an optional extra.

  Using the Agg canvas directly keeps pyplot's global state and GUI backends
  out of library code.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as err:
    raise PlotsUnavailableError(
      "plots need matplotlib, which is not installed: pip install "
      "matplotlib (or the 'plots' extra: pip install -e '.[plots]')"
    ) from err
  return Figure, FigureCanvasAgg
