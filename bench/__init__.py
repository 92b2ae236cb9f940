"""Benchmarks for serve_app (run as modules, e.g. ``python -m bench.render_bench``)."""
