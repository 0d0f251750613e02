package engine

import (
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// This file exposes what the workers themselves report about their load,
// for checks of what peers claim (routing/sync holds peers' decisions up
// to the workers' scraped request counts).

// ScrapedLoad is an endpoint's last scraped load as the engine holds it.
type ScrapedLoad struct {
	Endpoint routing.EndpointKey
	Role     routing.Role
	// Load is the last load ReportLoad published (summed over the ranks);
	// the zero Load before the first scrape.
	Load routing.Load
	// At is when that load was reported, on the engine's clock; zero
	// before the first report.
	At time.Time
	// LocalInFlight is this engine's own decisions open on the endpoint
	// now (not its peers').
	LocalInFlight int64
	// KVCapacityTokens is what one rank of the worker's KV cache holds,
	// in tokens (Load.KVBlocks × the block size the worker reports, else
	// the endpoint's); 0: unknown.
	KVCapacityTokens int
}

// ScrapedLoads appends the scraped load of every endpoint of the current
// set to dst and returns it. It does not block; callers may reuse dst.
func (e *Engine) ScrapedLoads(dst []ScrapedLoad) []ScrapedLoad {
	for _, st := range e.snap.Load().eps {
		dst = append(dst, e.scrapedLoad(st))
	}
	return dst
}

// ScrapedLoadOf returns one endpoint's scraped load; false when the
// endpoint is not in the current set.
func (e *Engine) ScrapedLoadOf(ep routing.EndpointKey) (ScrapedLoad, bool) {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return ScrapedLoad{}, false
	}
	return e.scrapedLoad(st), true
}

func (e *Engine) scrapedLoad(st *endpoint) ScrapedLoad {
	// The time first: ReportLoad stores it after the load, so a load read
	// after it is at least as new (never a stale load under a new time).
	at := st.scrapedAt.Load()
	sl := ScrapedLoad{Endpoint: st.Key, Role: st.Role, Load: st.load(), LocalInFlight: st.InFlight.Load()}
	if at != 0 {
		sl.At = time.Unix(0, at)
	}
	if sl.Load.KVBlocks > 0 {
		// num_gpu_blocks counts blocks of the worker's own block size.
		bs := int(st.runtime.blockSize.Load())
		if bs <= 0 {
			bs = e.blockSize(st)
		}
		sl.KVCapacityTokens = sl.Load.KVBlocks * bs
	}
	return sl
}
