"""What the benchmarks share; each ``bench/*_bench.py`` is a script on top of it.

* :mod:`bench.common.paths` - where results and server logs go.
* :mod:`bench.common.servers` - free ports, waiting for HTTP, stopping process groups, ``vllm launch render``
  and coupled ``vllm serve``.
* :mod:`bench.common.serve_cluster` - our app on a fresh local Ray Serve cluster, one configuration per
  worker process (Serve reads ``RAY_SERVE_*`` at import time), waiting for HAProxy.
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
  joining a stream's chunks for parity checks.
* :mod:`bench.common.stats` - percentiles, latency summaries, a trend's slope.
* :mod:`bench.common.report` - machine info, number formatting, writing ``bench/results/*.md`` / ``.json``.

Scenarios shared with the tests (the local autoscaling cluster, engine failover, tool payloads, the
derender stream client, reading the app's /metrics) live in :mod:`tests.harness`; no bench imports another bench.
"""
