#!/usr/bin/env bash
# debs.sh — install the Debian packages the test suites need, only those the
# machine lacks (make test runs it first; so does .ci/run). Without root or
# apt-get it names the missing packages and fails.
set -euo pipefail
need=()
# The tokenizer oracles: node + npm (HF's tokenizers@0.23.2 is fetched by
# `make fixtures`) and Python's Jinja2 (the chat-template oracle).
command -v node >/dev/null && command -v npm >/dev/null || need+=(nodejs npm)
python3 -c 'import jinja2' 2>/dev/null || need+=(python3 python3-jinja2)
# The e2e suite runs in a private network namespace: unshare (util-linux)
# and ip (iproute2) bring up its loopback.
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
# The libzmq interop tests (routing/kvevents/zmtp, routing/kvevents) run a pyzmq
# peer with Debian's interpreter, which is what has python3-zmq.
/usr/bin/python3 -c 'import zmq' 2>/dev/null || need+=(python3-zmq)
# The container image test (e2e/image): buildah builds the image offline,
# podman runs it with runc.
command -v buildah >/dev/null || need+=(buildah)
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
# The dashboard and alert rules (gateway-api/monitoring_test.go,
# e2e/monitoring_test.go): promtool and a real Prometheus server.
command -v promtool >/dev/null && command -v prometheus >/dev/null || need+=(prometheus)
((${#need[@]})) || exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "debs.sh: the test suites need these Debian packages: ${need[*]}" >&2
  echo "debs.sh: install them (sudo apt-get install ${need[*]}) and run again" >&2
  exit 1
fi
echo "installing ${need[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
