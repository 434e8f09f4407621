"""DISCO latency on a real bandwidth-limited link, beside the latency model.

  python -m experiments.disco_latency --out=DIR [--rates=100,1000,10000]

Two processes, one per node, each pinned to its own core with one CPU
device (with --nodes=4, four processes, two to each of the machine's two
cores), run `disco.distributed` programs and talk over the loopback of a
private network namespace whose bandwidth is limited by a token bucket:

  unshare --net sh -c 'ip link set lo mtu 1500 && ip link set lo up &&
    tc qdisc add dev lo root tbf rate <R>mbit burst 64kb latency 50ms &&
    python -m experiments.disco_latency --role=link ...'

(the MTU must be lowered: 64 KB loopback packets exceed the bucket). For
every rate, model (the digits-sized ResNet and the x2 SR generator, random
weights with the masks magnitude-selected at --comm_ratio: latency does not
depend on training) and batch (1 and --batch): the median time of one call
of dense channel parallelism and of DISCO, and of the model on one device
(node 0's process, after the other has finished). Beside each, the
`disco.metrics.LatencyModel` prediction for the same link: compute rate
calibrated on the one-device time, `shared=True` because both nodes'
traffic passes the one throttled loopback, and the cost of one collective
call and the bandwidth fitted on the link itself (`fit_link`: ppermute
calls of 64 B to 256 KB timed before the models, least squares). The
processes are pinned while JAX sizes its thread pools, then released
(`common.release_threads`): pinned, the threads that wait on collectives
queue behind the compute thread. `results.json` has `links`, one row per
(rate, model, batch). Without permission for `unshare --net` and `tc`
(root or CAP_NET_ADMIN) it says so and exits.
"""

import json
import os
import shutil
import subprocess
import sys
import time

from experiments import common

ROLE_FLAG = "--role=node"

if __name__ == "__main__" and ROLE_FLAG in sys.argv:
  # A node: its own core and one device, before JAX starts.
  common.pin_to_core(int(os.environ.get("GRAPHPIPE_PROCESS_ID", "0")))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

MODELS = ("resnet", "srnet")
RESULT = "RESULT "


def _names(text: str) -> list[str]:
  """The names of a comma-separated flag value, blanks dropped."""
  return [name for name in text.split(",") if name]


def _positive_numbers(text: str) -> bool:
  try:
    values = [float(v) for v in text.split(",")]
  except ValueError:
    return False
  return all(0 < v < float("inf") for v in values)


def define_flags() -> None:
  """The experiment's flags."""
  common.define_out(required=False)
  flags.DEFINE_string("rates", "100,1000,10000", "Link rates, Mbit/s.")
  flags.register_validator(
    "rates",
    _positive_numbers,
    message="--rates takes link rates > 0 (Mbit/s), separated by commas",
  )
  flags.DEFINE_string("models", ",".join(MODELS), "Models to time.")
  flags.register_validator(
    "models",
    lambda text: bool(_names(text)) and set(_names(text)) <= set(MODELS),
    message=f"--models takes one or more of {', '.join(MODELS)}, separated "
    "by commas",
  )
  flags.DEFINE_integer(
    "batch", 64, "The large batch (1 is always timed).", lower_bound=1
  )
  flags.DEFINE_integer(
    "repeats", 10, "Timed calls per figure (median).", lower_bound=1
  )
  flags.DEFINE_float(
    "comm_ratio",
    0.2,
    "DISCO's communication ratio.",
    lower_bound=0,
    upper_bound=1,
  )
  flags.DEFINE_float(
    "message_latency",
    None,
    "Model: seconds per collective call (default: fitted on the link).",
    lower_bound=0,
  )
  flags.DEFINE_enum(
    "nodes",
    "2",
    ["2", "4"],
    "Node processes (one device each). 4 share the machine's 2 cores two "
    "to a core: see the page for what that measures.",
  )
  flags.DEFINE_enum("role", "main", ["main", "link", "node"], "Internal.")
  common.define_flags()


def build(name: str, keep: bool | None, ratio: float, nodes: int = 2):
  """The model `name` over `nodes` at `ratio` (DISCO), or all masks `keep`
  (dense).

  Example:
    >>> build("srnet", None, 0.2).config.scale
    2
  """
  from flax import nnx

  from disco import metrics, prune
  from disco.models import ResNet, ResNetConfig, SRConfig, SRNet

  if name == "resnet":
    model = ResNet(ResNetConfig(num_nodes=nodes), rngs=nnx.Rngs(0))
  else:
    config = SRConfig(width=16, growth=8, image_size=16, num_nodes=nodes)
    model = SRNet(config, rngs=nnx.Rngs(0))
  prune.to_ratio(model, ratio, selection="magnitude")
  model.eval()
  return model if keep is None else metrics.with_masks(model, keep)


def timed_batches(batch: int) -> list[int]:
  """The batch sizes each model is timed at: 1 and `batch`, once each
  (--batch=1 wrote two rows of batch 1)."""
  return sorted({1, batch})


def _node(settings: dict) -> None:
  """One node's process: times dense and DISCO; node 0 adds one device."""
  from graphpipe.runtime.launch import initialize_from_env

  initialize_from_env()
  import jax
  import jax.numpy as jnp

  from disco import distributed

  jnp.zeros(1).block_until_ready()  # the client and its pools exist
  common.release_threads()
  nodes = settings["nodes"]
  mesh = distributed.node_mesh(nodes)
  link = _time_link(mesh, settings["repeats"])
  chain = _time_chain(mesh, settings["repeats"])
  rows = []
  for name in settings["models"]:
    for batch in timed_batches(settings["batch"]):
      row = {"model": name, "batch": batch}
      for variant, keep in (("dense", True), ("disco", None)):
        model = build(name, keep, settings["comm_ratio"], nodes)
        run = distributed.distribute(model, mesh)
        images = np.random.default_rng(0).random(
          (batch, *run.image_shape), np.float32
        )
        row[f"{variant}_ms"], row[f"{variant}_p10_ms"] = _ms_percentiles(
          run.apply, run.place(images), settings["repeats"]
        )
        row[f"{variant}_bytes"] = run.bytes_per_inference(batch) * batch
      rows.append(row)
  if jax.process_index() == 0:
    from flax import nnx

    device = jax.local_devices()[0]
    for row in rows:
      model = build(row["model"], True, settings["comm_ratio"], nodes)
      graphdef, state = nnx.split(model)
      state = jax.device_put(state, device)
      forward = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
      shape = model.config.image_size, model.config.image_size
      images = np.zeros((row["batch"], *shape, model.config.in_channels))
      placed = jax.device_put(images.astype(np.float32), device)
      row["one_device_ms"], row["one_device_p10_ms"] = _ms_percentiles(
        lambda x, f=forward, s=state: f(s, x), placed, settings["repeats"]
      )
    print(
      RESULT + json.dumps({"rows": rows, "link": link, "chain": chain}),
      flush=True,
    )


LINK_SIZES = (64, 1024, 4096, 16384, 65536, 262144)
BURST_BYTES = 64 * 1024  # the token bucket's burst (namespace_command)


def _ring(mesh) -> list[tuple[int, int]]:
  """Each node sends to the next (2 nodes: to each other)."""
  from disco.exchange import AXIS

  n = mesh.shape[AXIS]
  return [(i, (i + 1) % n) for i in range(n)]


def _time_link(mesh, repeats: int) -> list[list[float]]:
  """[bytes all nodes send, median seconds, 10th-percentile seconds] of
  one ppermute call in which each node sends the next `size` bytes, for
  each of LINK_SIZES."""
  import jax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from disco.exchange import AXIS

  swap = jax.jit(
    jax.shard_map(
      lambda x: lax.ppermute(x, AXIS, _ring(mesh)),
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
    )
  )
  nodes = mesh.shape[AXIS]
  warm = jax.make_array_from_callback(
    (nodes,), NamedSharding(mesh, P(AXIS)), lambda _: np.ones(1, np.float32)
  )
  for _ in range(200):  # the first calls of a run take ms
    swap(warm).block_until_ready()
  points = []
  for size in LINK_SIZES:
    n = size // 4
    x = jax.make_array_from_callback(
      (nodes * n,),
      NamedSharding(mesh, P(AXIS)),
      lambda _, n=n: np.ones(n, np.float32),
    )
    seconds = _times(swap, x, max(repeats, 20))
    points.append([nodes * size, *np.percentile(seconds, [50, 10]).tolist()])
  return points


CHAIN_CALLS = (1, 2, 4, 8, 16)


def _time_chain(mesh, repeats: int) -> list[list[float]]:
  """[calls, median seconds] of one program of that many ppermute calls
  of 64 B each, one after another (each sends what the last received,
  plus one), for each of CHAIN_CALLS: a model's program makes its calls
  in such a chain, each waiting for every node."""
  import jax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from disco.exchange import AXIS

  def chain(calls):
    def body(x):
      for _ in range(calls):
        x = lax.ppermute(x, AXIS, _ring(mesh)) + 1.0
      return x

    return jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    )

  x = jax.make_array_from_callback(
    (16 * mesh.shape[AXIS],),
    NamedSharding(mesh, P(AXIS)),
    lambda _: np.ones(16, np.float32),
  )
  points = []
  for calls in CHAIN_CALLS:
    program = chain(calls)
    for _ in range(50):
      program(x).block_until_ready()
    seconds = _times(program, x, max(repeats, 20))
    points.append([calls, float(np.median(seconds))])
  return points


def fit_chain(points) -> dict:
  """The cost of one more call inside a program, from `_time_chain`'s
  [calls, seconds]: (seconds of the longest chain - seconds of the
  shortest) / the calls between them. `fit_link`'s call cost is that of
  a program of one call; the models' programs make theirs in a chain.

  Example:
    >>> fit = fit_chain([[1, 3e-4], [4, 6e-4], [16, 1.8e-3]])
    >>> round(fit["chain_call"], 6)
    0.0001
  """
  points = sorted((float(c), float(t)) for c, t in points)
  (first, quick), (last, slow) = points[0], points[-1]
  if last <= first:
    raise ValueError(f"the chain fit needs two call counts: {points}")
  return {"chain_call": (slow - quick) / (last - first)}


def fit_link(points) -> dict:
  """The cost of one collective call and the bandwidth, fitted on timed
  calls: seconds = call + bytes / bandwidth.

  The call's cost is the quickest of the calls within the burst (the
  token bucket lets its 64 KB through at once, so they cost the same
  whatever their bytes, and a straight line through every size would put
  their cost on the bandwidth), each size by its 10th percentile when
  given: in some runs every small call of a size stalled for one 4 ms
  timer tick (median 4.0 ms, 0.25-0.4 ms in other runs and inside the
  models' programs). The bandwidth is then fitted by least squares on the
  medians of the calls above the burst, beyond the call's cost.

  Example:
    >>> small = [[b, 2e-4] for b in (128, 2048)]  # within the burst
    >>> large = [[b, 2e-4 + b / 12.5e6] for b in (2**17, 2**19)]
    >>> fit = fit_link(small + large)
    >>> round(fit["message_latency"], 6), round(fit["bytes_per_second"])
    (0.0002, 12500000)

  Args:
    points: [bytes sent, median seconds(, quick seconds)] per timed size.
  """
  points = [list(point) for point in points]
  sizes = np.asarray([point[0] for point in points], float)
  seconds = np.asarray([point[1] for point in points], float)
  quick = np.asarray([point[-1] for point in points], float)
  small, large = sizes <= BURST_BYTES, sizes > BURST_BYTES
  if not small.any():
    raise ValueError(f"no timed call within {BURST_BYTES} bytes: {points}")
  call = float(min(quick[small]))
  if not large.any():
    raise ValueError(f"no timed call above {BURST_BYTES} bytes: {points}")
  extra = seconds[large] - call
  per_byte = float(
    np.dot(extra, sizes[large]) / np.dot(sizes[large], sizes[large])
  )
  if not per_byte > 0:
    raise ValueError(
      "the link fit has no positive slope: the timed calls above the burst "
      f"took no longer than the smallest ones: {points}"
    )
  return {"message_latency": call, "bytes_per_second": 1 / per_byte}


def _ms_percentiles(call, placed, repeats: int) -> tuple[float, float]:
  """(median, 10th percentile) milliseconds of `repeats` calls."""
  seconds = _times(call, placed, repeats)
  return tuple(1e3 * float(v) for v in np.percentile(seconds, [50, 10]))


def _times(call, placed, repeats: int) -> list[float]:
  """Seconds of `repeats` calls, after a compiling and a warm-up call."""
  for _ in range(2):
    call(placed).block_until_ready()
  times = []
  for _ in range(repeats):
    begin = time.perf_counter()
    call(placed).block_until_ready()
    times.append(time.perf_counter() - begin)
  return times


def _link(settings: dict) -> None:
  """Inside the namespace: the two node processes; relays node 0's rows."""
  from graphpipe.runtime.launch import launch

  argv = ["-m", "experiments.disco_latency", ROLE_FLAG]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {
    "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "DISCO_LATENCY_SETTINGS": json.dumps(settings),
  }
  outputs = launch(argv, settings["nodes"], 1, env=env, timeout=1800)
  for line in outputs[0].splitlines():
    if line.startswith(RESULT):
      print(line, flush=True)


def namespace_command(rate_mbit: float, command: str) -> list[str]:
  """`command` in a new network namespace with loopback throttled.

  Example:
    >>> namespace_command(100, "true")[:2]
    ['unshare', '--net']
  """
  setup = (
    "ip link set lo mtu 1500 && ip link set lo up && "
    f"tc qdisc add dev lo root tbf rate {rate_mbit:g}mbit "
    f"burst {BURST_BYTES // 1024}kb "
    "latency 50ms"
  )
  return ["unshare", "--net", "sh", "-c", f"{setup} && {command}"]


def splits_refused(settings: dict) -> str | None:
  """None when every model of `settings` splits over its nodes, else why
  not (the node processes would fail after the link was timed).

  Example:
    >>> splits_refused({"models": ["srnet"], "nodes": 4, "comm_ratio": 0.2})
    'srnet over 4 nodes: ...'
  """
  from disco.errors import DiscoError

  for name in settings["models"]:
    try:
      build(name, None, settings["comm_ratio"], settings["nodes"])
    except DiscoError as error:
      return f"{name} over {settings['nodes']} nodes: {error}"
  return None


def check_link_permitted() -> str | None:
  """None when a throttled namespace can be made here, else why not."""
  missing = [t for t in ("unshare", "tc", "ip") if shutil.which(t) is None]
  if missing:
    return f"{', '.join(missing)} not found"
  probe = subprocess.run(
    namespace_command(100, "true"), capture_output=True, text=True, timeout=60
  )
  if probe.returncode != 0:
    return probe.stderr.strip() or f"exit status {probe.returncode}"
  return None


def predict(row: dict, link: dict, settings: dict) -> dict:
  """The latency model's dense and DISCO milliseconds for `row`'s link.

  Example:
    >>> row = {"model": "resnet", "batch": 1, "one_device_ms": 1.0}
    >>> link = {"message_latency": 2e-4, "bytes_per_second": 12.5e6}
    >>> p = predict(row, link, {"comm_ratio": 0.2, "message_latency": None})
    >>> p["predicted_disco_ms"] < p["predicted_dense_ms"]
    True

  Args:
    row: a timed row (model, batch, one_device_ms).
    link: `fit_link`'s figures for the link.
    settings: comm_ratio; message_latency (None: the fitted one); nodes
      (default 2).
  """
  from disco import metrics

  def report(keep):
    model = build(
      row["model"], keep, settings["comm_ratio"], settings.get("nodes", 2)
    )
    config = model.config
    size = config.image_size
    shape = (row["batch"], size, size, config.in_channels)
    return metrics.count(model, input_shape=shape)

  dense, disco = report(True), report(None)
  message_latency = settings["message_latency"]
  figures = {}
  for prefix, burst in (("predicted", BURST_BYTES), ("wire", None)):
    model = metrics.LatencyModel(
      flops_per_second=dense.flops / (row["one_device_ms"] / 1e3),
      bytes_per_second=link["bytes_per_second"],
      message_latency=link["message_latency"]
      if message_latency is None
      else message_latency,
      shared=True,
      burst_bytes=burst,
    )
    figures[f"{prefix}_dense_ms"] = 1e3 * model.latency(dense)
    figures[f"{prefix}_disco_ms"] = 1e3 * model.latency(disco)
  return figures


def main(argv):
  common.start(argv)
  f = flags.FLAGS
  if f.role == "node":
    return _node(json.loads(os.environ["DISCO_LATENCY_SETTINGS"]))
  settings = {
    "models": _names(f.models),
    "batch": f.batch,
    "repeats": f.repeats,
    "comm_ratio": f.comm_ratio,
    "message_latency": f.message_latency,
    "nodes": int(f.nodes),
  }
  if f.role == "link":
    return _link(settings)
  if not f.out:
    raise app.UsageError("--out is required")
  why = splits_refused(settings)
  if why is not None:
    sys.exit(f"disco_latency: error: {why}")
  why = check_link_permitted()
  if why is not None:
    sys.exit(
      "disco_latency: error: cannot make a bandwidth-limited link here "
      "(needs `unshare --net` and `tc`, i.e. root or CAP_NET_ADMIN): "
      f"{why}"
    )
  started = time.perf_counter()
  links, fitted = [], []
  rates = [float(r) for r in f.rates.split(",")]
  progress = common.Progress(len(rates), "link rate")
  for rate in rates:
    command = (
      f"{sys.executable} -m experiments.disco_latency --role=link "
      f"--models={f.models} --batch={f.batch} --repeats={f.repeats} "
      f"--comm_ratio={f.comm_ratio} --nodes={f.nodes}"
    )
    done = subprocess.run(
      namespace_command(rate, command),
      capture_output=True,
      text=True,
      timeout=3600,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
    if done.returncode != 0 or not lines:
      sys.exit(
        f"disco_latency: error: the run at {rate:g} Mbit/s failed:\n"
        f"{(done.stdout + done.stderr)[-3000:]}"
      )
    result = json.loads(lines[-1][len(RESULT) :])
    fit = fit_link(result["link"])
    chained = fit_chain(result["chain"])
    fitted.append(
      {
        "rate_mbit": rate,
        **fit,
        **chained,
        "timed": result["link"],
        "chain_timed": result["chain"],
      }
    )
    common.log(
      f"{rate:g} Mbit/s link: {1e3 * fit['message_latency']:.3f} ms per "
      f"call, {8 * fit['bytes_per_second'] / 1e6:.0f} Mbit/s fitted; "
      f"{1e3 * chained['chain_call']:.3f} ms per call in a chain"
    )
    for row in result["rows"]:
      row = {"rate_mbit": rate, **row, **predict(row, fit, settings)}
      row["dense_over_disco"] = row["dense_ms"] / row["disco_ms"]
      for variant in ("dense", "disco"):
        for measured in ("", "_p10"):
          row[f"{variant}{measured}_over_model"] = (
            row[f"{variant}{measured}_ms"] / row[f"predicted_{variant}_ms"]
          )
      links.append(row)
      common.log(
        f"{rate:g} Mbit/s {row['model']} batch {row['batch']}: one device "
        f"{row['one_device_ms']:.2f} ms, dense {row['dense_ms']:.2f} ms "
        f"(model {row['predicted_dense_ms']:.2f}), DISCO "
        f"{row['disco_ms']:.2f} ms (model {row['predicted_disco_ms']:.2f})"
      )
    progress.step(f"{rate:g} Mbit/s")
  results = {
    "links": links,
    "link_fits": fitted,
    "settings": settings,
    "definitions": {
      "*_ms": "median milliseconds of one call (the whole batch)",
      "predicted_*": "disco.metrics.LatencyModel of the link: a token "
      "bucket (burst 64 KB) shared by both nodes, call cost and bandwidth "
      "from link_fits (message_latency when set), compute rate calibrated "
      "on one_device_ms",
      "wire_*": "the same model on a wire (every byte at the rate, no burst)",
      "*_over_model": "measured / predicted",
      "*_p10_ms": "10th percentile of the same calls: a call that no "
      "scheduling stall reached (the link fit's call cost is such a "
      "percentile)",
      "link_fits": "per rate: seconds per ppermute call (message_latency) "
      "and bytes_per_second fitted on timed calls [bytes both nodes send, "
      "median seconds, 10th-percentile seconds]; chain_call: seconds one "
      "more call adds inside a program of chained 64 B calls (not used by "
      "the model), from chain_timed [calls, median seconds]",
      "*_bytes": "bytes the compiled program sends per call",
    },
    "wall_seconds": round(time.perf_counter() - started, 1),
    "load_average": os.getloadavg(),
  }
  path = common.write_results(f.out, results)
  common.log(f"wrote {path}")
  for row in links:
    print(json.dumps(row))


if __name__ == "__main__":
  define_flags()
  app.run(main)
