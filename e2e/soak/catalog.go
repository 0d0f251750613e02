package main

import (
	"context"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// env is what the load classes talk to.
type env struct {
	envoyURL, envoyAddr string // envoysim
	proxyURL, proxyAddr string // kvbandit --http-addr
	grpcAddr            string
	metricsAddr         string
	fleet               *fleet
	http                *http.Client
	extproc             extprocv3.ExternalProcessorClient
	maxBody             int64
	churnEvery          time.Duration
	restartEvery        time.Duration
	kvFloodRate         float64
	seed                uint64

	bigOnce sync.Once
	big     []byte
}

func (e *env) isWorker(addr string) bool {
	for _, w := range e.fleet.workers {
		if w.httpAddr == addr {
			return true
		}
	}
	return false
}

func (e *env) randomWorker(rng *rand.Rand) string {
	return e.fleet.workers[rng.IntN(len(e.fleet.workers))].httpAddr
}

// classCatalog lists the classes with their rates (for -list and flag
// checks); their functions need an env and are never called from here.
func classCatalog(o options) []*class { return catalog(o, &env{}) }

// catalog is every load class, with its rate for these options.
func catalog(o options, e *env) []*class {
	r, h := o.Rate, o.HostileScale
	c := []*class{
		// Normal traffic: what must keep working.
		{name: "chat_envoy", group: groupNormal, rate: 0.3 * r, maxOpen: 64, about: "chat completion through envoysim (JSON)", do: e.chat(e.envoyURL, false)},
		{name: "chat_stream_envoy", group: groupNormal, rate: 0.3 * r, maxOpen: 64, about: "chat completion through envoysim (SSE)", do: e.chat(e.envoyURL, true)},
		{name: "completion_envoy", group: groupNormal, rate: 0.1 * r, maxOpen: 32, about: "completion through envoysim (JSON)", do: e.completion(e.envoyURL, false)},
		{name: "completion_stream_envoy", group: groupNormal, rate: 0.1 * r, maxOpen: 32, about: "completion through envoysim (SSE)", do: e.completion(e.envoyURL, true)},
		{name: "agent_envoy", group: groupNormal, rate: 0.05 * r, maxOpen: 16, about: "3-6 turn agent session through envoysim, x-prefix-* hints or nvext.agent_hints", do: e.agent(e.envoyURL)},
		{name: "chat_proxy", group: groupNormal, rate: 0.15 * r, maxOpen: 32, about: "chat completion through the standalone proxy (JSON), served by a worker", do: e.chat(e.proxyURL, false)},
		{name: "chat_stream_proxy", group: groupNormal, rate: 0.1 * r, maxOpen: 32, about: "chat completion through the standalone proxy (SSE)", do: e.chat(e.proxyURL, true)},
		{name: "agent_proxy", group: groupNormal, rate: 0.02 * r, maxOpen: 8, about: "agent session through the standalone proxy", do: e.agent(e.proxyURL)},

		// Clients that go away, and bad requests.
		{name: "cancel_body_envoy", group: groupClientErrors, rate: 0.5 * h, maxOpen: 16, about: "sends part of the declared body, then goes away", do: e.cancelBody(e.envoyURL)},
		{name: "cancel_body_proxy", group: groupClientErrors, rate: 0.3 * h, maxOpen: 16, about: "the same on the standalone proxy", do: e.cancelBody(e.proxyURL)},
		{name: "cancel_stream_envoy", group: groupClientErrors, rate: 0.5 * h, maxOpen: 16, about: "reads 1-20 SSE chunks of a long generation, then goes away", do: e.cancelStream(e.envoyURL)},
		{name: "cancel_stream_proxy", group: groupClientErrors, rate: 0.3 * h, maxOpen: 16, about: "the same on the standalone proxy", do: e.cancelStream(e.proxyURL)},
		{name: "unknown_model_envoy", group: groupClientErrors, rate: 0.3 * h, maxOpen: 16, about: "a model no worker serves: 404", do: e.unknownModel(e.envoyURL)},
		{name: "unknown_model_proxy", group: groupClientErrors, rate: 0.2 * h, maxOpen: 16, about: "the same on the standalone proxy", do: e.unknownModel(e.proxyURL)},
		{name: "invalid_json_envoy", group: groupClientErrors, rate: 0.3 * h, maxOpen: 16, about: "invalid JSON, no model, wrong types: 400", do: e.invalidJSON(e.envoyURL)},
		{name: "invalid_json_proxy", group: groupClientErrors, rate: 0.2 * h, maxOpen: 16, about: "the same on the standalone proxy", do: e.invalidJSON(e.proxyURL)},
		{name: "oversized_envoy", group: groupClientErrors, rate: 0.04 * h, maxOpen: 2, about: "a body over --max-body-bytes: 413", do: e.oversized(e.envoyURL)},
		{name: "oversized_proxy", group: groupClientErrors, rate: 0.04 * h, maxOpen: 2, about: "the same on the standalone proxy", do: e.oversized(e.proxyURL)},

		// Hostile HTTP.
		{name: "huge_cl_proxy", group: groupHostileHTTP, rate: 0.5 * h, maxOpen: 24, about: "declares up to 1 TiB of body, sends 1 byte: 413 or a timeout answer, never a wait", do: e.hugeContentLength(e.proxyAddr)},
		{name: "huge_cl_envoy", group: groupHostileHTTP, rate: 0.3 * h, maxOpen: 12, about: "the same through envoysim (ext_proc's decision timeout)", do: e.hugeContentLength(e.envoyAddr)},
		{name: "slow_body_proxy", group: groupHostileHTTP, rate: 0.3 * h, maxOpen: 12, about: "a valid body a few bytes every 0.3-1 s: 408/503 before it is complete", do: e.slowBody(e.proxyAddr)},
		{name: "slow_body_envoy", group: groupHostileHTTP, rate: 0.3 * h, maxOpen: 12, about: "the same through envoysim", do: e.slowBody(e.envoyAddr)},
		{name: "traversal_proxy", group: groupHostileHTTP, rate: 1 * h, maxOpen: 16, about: "`..`, %2e and %2f paths: never a page outside /v1/", do: e.traversal(e.proxyAddr)},
		{name: "spoof_proxy", group: groupHostileHTTP, rate: 0.5 * h, maxOpen: 16, about: "spoofed x-gateway-destination-endpoint* and friends: still served by a worker kvbandit chose", do: e.spoof(e.proxyURL)},
		{name: "spoof_envoy", group: groupHostileHTTP, rate: 0.5 * h, maxOpen: 16, about: "the same through envoysim", do: e.spoof(e.envoyURL)},
		{name: "huge_header_proxy", group: groupHostileHTTP, rate: 0.2 * h, maxOpen: 4, about: "one header of 256 KiB to 4 MiB: refused, not buffered", do: e.hugeHeader(e.proxyAddr)},
		{name: "many_headers_proxy", group: groupHostileHTTP, rate: 0.2 * h, maxOpen: 4, about: "1,000 to 16,000 headers", do: e.manyHeaders(e.proxyURL)},
		{name: "many_headers_envoy", group: groupHostileHTTP, rate: 0.2 * h, maxOpen: 4, about: "the same through envoysim (one ext_proc header map)", do: e.manyHeaders(e.envoyURL)},

		// Hostile ext_proc streams.
		{name: "idle_stream", group: groupHostileExtProc, rate: 1 * h, maxOpen: 32, about: "opens a stream and sends nothing for 1-20 s", do: e.idleStream},
		{name: "out_of_order", group: groupHostileExtProc, rate: 1 * h, maxOpen: 16, about: "messages out of order: the stream must end or be answered within 10 s", do: e.outOfOrder},
		{name: "long_tenant", group: groupHostileExtProc, rate: 1 * h, maxOpen: 8, about: "tenant header (--tenant-header) of 64-700 KB", do: e.longTenant},
		{name: "forged_served", group: groupHostileExtProc, rate: 3 * h, maxOpen: 16, about: "random envoy.lb / x-gateway-destination-endpoint-served in the response metadata", do: e.forgedServed},
		{name: "abandon_extproc", group: groupHostileExtProc, rate: 0.5 * h, maxOpen: 16, about: "takes a decision, then resets the stream", do: e.abandon},

		// KV events.
		{name: "zmtp_huge_frame", group: groupKV, rate: 0.1 * h, maxOpen: 2, about: "ZMTP frame or handshake command declaring up to 2^63 bytes, to a bound SUB socket", do: e.hugeFrame},
		{name: "zmtp_bad_msgpack", group: groupKV, rate: 0.5 * h, maxOpen: 4, about: "KV event messages with msgpack lengths of 4G, deep nesting, wrong frame counts", do: e.badMsgpack},
		{name: "zmtp_garbage", group: groupKV, rate: 0.5 * h, maxOpen: 4, about: "random bytes, bad greetings, wrong mechanism or socket type, a 4 GiB READY property", do: e.garbage},
		{name: "zmtp_stall", group: groupKV, rate: 0.2 * h, maxOpen: 4, about: "connects and sends nothing (or half a greeting) for 5-15 s", do: e.stall},
		{name: "kv_flood", group: groupKV, rate: o.KVFloodRate, maxOpen: 1, about: "valid KV events (BlockStored/BlockRemoved) to the flood endpoint's bound SUB socket", loop: e.floodLoop},

		// Faults.
		{name: "discovery_churn", group: "faults", rate: perSecond(o.ChurnEvery), maxOpen: 1, about: "rewrites the endpoints file: workers leave and return, metadata changes, bad records", loop: e.churnLoop},
		{name: "worker_restart", group: "faults", rate: perSecond(o.RestartEvery), maxOpen: 1, about: "kills a random worker and restarts it on the same ports", loop: e.restartLoop},
	}
	for _, x := range c {
		x.t = newTally()
	}
	return c
}

func perSecond(every time.Duration) float64 {
	if every <= 0 {
		return 0
	}
	return 1 / every.Seconds()
}

func (e *env) floodLoop(ctx context.Context, t *tally) {
	w := e.fleet.flood()
	fl := &flooder{endpoint: w.kvAddr, topic: []byte("kv@" + w.httpAddr + "@" + model), rate: e.kvFloodRate,
		rng: rand.New(rand.NewPCG(e.seed, 0xf100d)), t: t}
	fl.run(ctx, 5*time.Second)
}

func (e *env) churnLoop(ctx context.Context, t *tally) {
	if e.churnEvery <= 0 {
		return
	}
	rng := rand.New(rand.NewPCG(e.seed, 0xc4a2))
	tick := time.NewTicker(e.churnEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if _, err := e.fleet.churn(rng); err != nil {
			t.fail(err.Error())
			continue
		}
		t.ok()
	}
}

func (e *env) restartLoop(ctx context.Context, t *tally) {
	if e.restartEvery <= 0 {
		return
	}
	rng := rand.New(rand.NewPCG(e.seed, 0x4e57))
	for {
		d := time.Duration((0.5 + rng.Float64()) * float64(e.restartEvery))
		if !sleepCtx(ctx, d) {
			return
		}
		if err := e.fleet.restartOne(ctx, rng); err != nil {
			t.fail(err.Error())
			continue
		}
		t.ok()
	}
}
