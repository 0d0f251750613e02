package scrape

import "github.com/kvbandit/kvbandit/routing"

// Endpoints is the part of [routing.Engine] that EngineTargets and
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

// Reporter is the part of [routing.Engine] that takes scraped load.
type Reporter interface {
	ReportLoad(ep routing.EndpointKey, ld routing.Load, blockSize int) bool
}

// EnginePublish returns a Deps.Publish that reports each sample's load and
// the worker's block size (vllm:cache_config_info) to the engine; a sample
// for an endpoint that has left is dropped. Adapters and per-rank load are
// parsed but not passed on yet.
func EnginePublish(e Reporter) func(Target, Sample) {
	return func(t Target, s Sample) {
		e.ReportLoad(routing.EndpointKey(t.Key), s.Load(), s.BlockSize)
	}
}
