"""Scenario code shared by the tests and the benchmarks (``bench/`` imports it too): the local
autoscaling cluster and its scenario, the engine failover scenario, the tool payloads, and the
derender stream client. Not part of the product: ``serve_app/testing`` keeps only what vLLM's engine
loads (the scripted-output logits processor)."""
