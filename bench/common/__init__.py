"""What the benchmarks share; each ``bench/*_bench.py`` is a script on top of it.

* :mod:`bench.common.paths` - where results and server logs go.
* :mod:`bench.common.servers` - free ports, waiting for HTTP, stopping process groups, ``vllm launch render``
  and coupled ``vllm serve``.
* :mod:`bench.common.serve_cluster` - our app on a fresh local Ray Serve cluster (as ``make run`` or as
  ``serve_config.yaml`` lays it out), one configuration per worker process (Serve reads ``RAY_SERVE_*`` at
  import time), waiting for HAProxy; vLLM's reference servers and ours started side by side.
* :mod:`bench.common.ray_internals` - every use of Ray's private API (Serve flags, HAProxy and
  direct-ingress probes, deploying a config, the GCS actor table, Serve's hash ring), nowhere else.
* :mod:`bench.common.parser_stream` - the parser derender stream of the parser benches (app args,
  workload, one chunk's call, per-window latency).
* :mod:`bench.common.plots` - matplotlib helpers every plot uses.
* :mod:`bench.common.cpu` - CPU time per process role, from ``/proc``.
* :mod:`bench.common.procs` - RSS of every Serve process (GCS actor table, psutil).
* :mod:`bench.common.load` - driving a call from N workers and measuring it, or N workers running whole
  sessions (streams) into a ``Recorder`` with progress on stderr; the aiohttp client, SSE events.
* :mod:`bench.common.workloads` - the tool-and-reasoning chat and its output, the multilingual text,
  joining a stream's chunks and comparing two streams call by call for parity checks.
* :mod:`bench.common.stats` - percentiles, latency summaries, a trend's slope.
* :mod:`bench.common.report` - machine info, number formatting, table cells, parity verdicts, a bench's
  argument parser and options, writing ``bench/results/*.md`` / ``.json``.
* :mod:`bench.common.checked_http` - a client that checks and counts every request of a long mixed run
  (deadline = hang, 200 or a 4xx in the error envelope), into a ``Tally``.
* :mod:`bench.common.sampling` - sampling RSS, ``/metrics`` and the client's counts around a run's traffic,
  judging memory flatness and the parser-session cache.
* :mod:`bench.common.kills` - replicas SIGKILLed on a schedule, the failures each kill is blamed for.
* :mod:`bench.common.soak_report` - the soak's verdicts, report and plot from its JSON (memory, cache and
  request sections, plot panels).
* :mod:`bench.common.load_report` - ``load.json``'s report, and the plots from ``load.json`` and
  ``parser.json`` (``bench/plots.py`` is their CLI).
* :mod:`bench.common.render_report`, :mod:`bench.common.derender_report`, :mod:`bench.common.capacity_report` -
  the reports of ``render.json``, ``derender.json`` and ``capacity.json`` (capacity's plot and YAML too).

Scenarios shared with the tests (the local autoscaling cluster, engine failover, tool payloads, the
derender stream client, reading the app's /metrics) live in :mod:`tests.harness`; no bench imports another bench.
"""
