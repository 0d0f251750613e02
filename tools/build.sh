#!/usr/bin/env bash
# build.sh NAME... — build third-party tool binaries from their tools module
# (tools/NAME, pinned in its go.mod) into the cache, keyed by the module's
# content so a version bump rebuilds and nothing else does. Prints each
# binary's path. Cache: $KVBANDIT_TOOLS or ~/.cache/kvbandit/tools. An
# optional tools/NAME/ldflags file holds -ldflags (e.g. the version a binary
# reports) and is part of the key. An optional tools/NAME/prepare.sh runs
# first (it may generate files, e.g. from the project's own packages). An
# optional tools/NAME/cgo.env is sourced
# (bash) before the build to turn cgo on and set its flags; it, and every file
# in the tool's subfolders (e.g. a local module its go.mod replaces), are part
# of the key too.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KVBANDIT_TOOLS:-$HOME/.cache/kvbandit/tools}"
declare -A pkg=(
  [etcd]=github.com/kvbandit/kvbandit/tools/etcd
  [llm-d-inference-sim]=github.com/llm-d/llm-d-inference-sim/cmd/llm-d-inference-sim
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [helm]=helm.sh/helm/v3/cmd/helm
  [epp]=sigs.k8s.io/gateway-api-inference-extension/cmd/epp
  [nats-server]=github.com/nats-io/nats-server/v2
  [otelcol]=github.com/kvbandit/kvbandit/tools/otelcol
  [pd-sidecar]=github.com/llm-d/llm-d-inference-scheduler/cmd/pd-sidecar
  [llmd-epp]=github.com/llm-d/llm-d-inference-scheduler/cmd/epp
)
for name in "$@"; do
  dir="$here/$name"
  [[ -n "${pkg[$name]:-}" && -f "$dir/go.mod" ]] || { echo "build.sh: unknown tool $name" >&2; exit 2; }
  if [[ -x "$dir/prepare.sh" ]]; then "$dir/prepare.sh"; fi
  key="$(cat "$dir"/go.mod "$dir"/go.sum $(ls "$dir"/*.go "$dir"/ldflags "$dir"/cgo.env 2>/dev/null) \
    $(find "$dir" -mindepth 2 -type f | LC_ALL=C sort) | sha256sum | cut -c1-12)"
  ldflags="$(cat "$dir"/ldflags 2>/dev/null || true)"
  out="$cache/$name-$key/$name"
  if [[ ! -x "$out" ]]; then
    # Test packages run in parallel and may ask for the same tool at once:
    # one builds (under a lock), the others wait for it and reuse the binary.
    mkdir -p "$(dirname "$out")"
    exec {lock}>"$out.lock"
    flock "$lock"
    if [[ ! -x "$out" ]]; then
      echo "building $name ($key) ..." >&2
      (cd "$dir" && export CGO_ENABLED=0 && { [[ ! -f cgo.env ]] || source ./cgo.env; } &&
        GOWORK=off go build -trimpath -ldflags="$ldflags" -o "$out.tmp.$$" "${pkg[$name]}") ||
        { echo "build.sh: building $name failed" >&2; rm -f "$out.tmp.$$"; exit 1; }
      mv "$out.tmp.$$" "$out"
    fi
    exec {lock}>&-
  fi
  echo "$out"
done
