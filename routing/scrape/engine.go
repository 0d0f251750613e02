package scrape

import (
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// Endpoints is the part of [engine.Engine] that EngineTargets and
// EnginePublish use.
type Endpoints interface {
	Endpoints() []*routing.EndpointState
}

// EngineTargets returns a Deps.Targets that scrapes every endpoint of the
// engine's current snapshot at its metrics URL (http://<key>/metrics unless
// discovery gave one).
func EngineTargets(e Endpoints) func() []Target {
	return func() []Target {
		eps := e.Endpoints()
		ts := make([]Target, 0, len(eps))
		for _, ep := range eps {
			ts = append(ts, Target{Key: string(ep.Key), URL: ep.MetricsURL})
		}
		return ts
	}
}

// Reporter is the part of [engine.Engine] that takes scraped load.
type Reporter interface {
	ReportLoad(ep routing.EndpointKey, ld routing.Load, blockSize int) bool
	ReportAdapters(ep routing.EndpointKey, adapters []routing.ModelName) bool
	ReportRankLoads(ep routing.EndpointKey, ranks []routing.Load) bool
}

var _ Reporter = (*engine.Engine)(nil)

// EnginePublish returns a Deps.Publish that reports each sample to the
// engine: the LoRA adapters the worker runs (vllm:lora_requests_info), the
// load of each data-parallel rank when the worker labels its series by
// rank, then the endpoint's load and block size (vllm:cache_config_info).
// A sample for an endpoint that has left is dropped. Stale marks are
// reported too; they do not end an ejection for failed scrapes.
func EnginePublish(e Reporter) func(Target, Sample) {
	return func(t Target, s Sample) {
		key := routing.EndpointKey(t.Key)
		if !s.Stale {
			adapters := make([]routing.ModelName, len(s.Adapters))
			for i, a := range s.Adapters {
				adapters[i] = routing.ModelName(a)
			}
			if !e.ReportAdapters(key, adapters) {
				return
			}
			e.ReportRankLoads(key, s.rankLoads())
		}
		e.ReportLoad(key, s.Load(), s.BlockSize)
	}
}

// rankLoads returns the per-rank load indexed by rank, or nil unless the
// sample has two or more ranks numbered 0, 1, ... without gaps (vLLM's
// engine label on a data-parallel worker).
func (s Sample) rankLoads() []routing.Load {
	if len(s.Ranks) < 2 {
		return nil
	}
	out := make([]routing.Load, len(s.Ranks))
	for i, r := range s.Ranks {
		if r.Rank != i {
			return nil
		}
		out[i] = routing.Load{Waiting: r.Waiting, Running: r.Running, KVUsage: r.KVUsage, Known: s.Known, Stale: s.Stale, Finished: r.Finished, FinishedKnown: s.FinishedKnown}
	}
	return out
}

// FailureReporter is the part of [engine.Engine] that takes failed
// scrapes.
type FailureReporter interface {
	ReportScrapeFailure(ep routing.EndpointKey) bool
}

var _ FailureReporter = (*engine.Engine)(nil)

// EngineFailure returns a Deps.OnError that reports every failed scrape
// (timeout, non-200 status, oversized or malformed body, no load metrics,
// connection error) to the engine, which ejects an endpoint after several
// in a row, and then calls next when it is not nil (for logging).
func EngineFailure(e FailureReporter, next func(Target, error)) func(Target, error) {
	return func(t Target, err error) {
		e.ReportScrapeFailure(routing.EndpointKey(t.Key))
		if next != nil {
			next(t, err)
		}
	}
}
