"""What the benchmarks share; each ``bench/*_bench.py`` is a script on top of it.

* :mod:`bench.common.paths` - where results and server logs go.
* :mod:`bench.common.servers` - free ports, waiting for HTTP, stopping process groups, ``vllm launch render``
  and coupled ``vllm serve``.
* :mod:`bench.common.serve_cluster` - our app on a fresh local Ray Serve cluster, one configuration per
  worker process (Serve reads ``RAY_SERVE_*`` at import time), HAProxy and direct-ingress probes.
* :mod:`bench.common.cpu` - CPU time per process role, from ``/proc``.
* :mod:`bench.common.load` - driving a call from N workers and measuring it, or N workers running whole
  sessions (streams) into a ``Recorder`` with progress on stderr; the aiohttp client, SSE events.
* :mod:`bench.common.workloads` - the tool-and-reasoning chat and its output, the multilingual text,
  joining a stream's chunks for parity checks.
* :mod:`bench.common.stats` - percentiles and latency summaries.
* :mod:`bench.common.report` - machine info, number formatting, writing ``bench/results/*.md`` / ``.json``.
"""
