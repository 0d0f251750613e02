package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// Request is one request of a trace.
type Request struct {
	Arrival   time.Duration // offset from the trace start
	Tokens    []uint32      // prompt token ids (shared prefixes share ids)
	OutputLen int           // tokens to generate (>= 1)
	Hints     routing.Hints // x-prefix-* hints (agentic traces), zero otherwise
	Model     string        // "" = any
	Tenant    string
}

// WorkerConfig describes one simulated worker. Zero fields take the
// defaults (Dynamo's mocker).
type WorkerConfig struct {
	KVBlocks         int     // default 16384
	BlockSize        int     // default 64
	MaxNumSeqs       int     // default 256
	MaxBatchedTokens int     // default 8192
	Speed            float64 // default 1 (2 = twice as fast); must be > 0
	// Prefill is the time of a step that prefills newTokens uncached
	// prompt tokens (default MockerPrefill).
	Prefill func(newTokens int) time.Duration
	// Decode is the time of a decode-only step at KV utilisation kvUtil
	// (default MockerDecode).
	Decode func(kvUtil float64) time.Duration
	// CPUBlocks is the size of the worker's host-memory KV tier in blocks
	// (0: none). Blocks the GPU evicts move there (LRU), published as KV
	// events with medium CPU as vLLM's OffloadingConnector does; a request
	// whose next blocks are there loads them back at CPUReloadTokensPerSec
	// before its prefill instead of recomputing them.
	CPUBlocks int
	// CPUReloadTokensPerSec is the CPU tier's reload bandwidth in prompt
	// tokens per second (default DefaultCPUReloadTokensPerSec).
	CPUReloadTokensPerSec float64
}

// Change is a schedule entry: at At, worker Worker's speed becomes Speed.
// Speed 0 stops the worker (its requests wait; the step in progress
// completes), > 0 sets its speed factor.
type Change struct {
	Worker int
	At     time.Duration
	Speed  float64
}

// Config is a simulation.
type Config struct {
	Workers         []WorkerConfig
	Schedule        []Change
	Policy          string         // a name from policy.Builtin()
	Policies        *policy.Config // nil = defaults
	RouterBlockSize int            // default = the workers' BlockSize
	KVEvents        bool           // true: workers' KV events feed the engine's index (exact, trusted); false: approximate index only
	Seed            int64
	Logger          *slog.Logger
	// TierWeights price the workers' CPU-tier hits for the policies
	// (zero: routing.DefaultTierWeights).
	TierWeights routing.TierWeights

	// Replicas is the number of pickers: independent engines (same policy
	// and options, each its own random source, prefix store and index)
	// in front of the one fleet, as kvbandit serve replicas behind as
	// many Envoys. Each request enters through one of them chosen at
	// random (seeded by Seed). 0 or 1: one engine, exactly the run
	// without replicas. At most MaxReplicas.
	Replicas int
	// Sync is what the replicas share beyond the workers' own signals
	// (scraped load and KV events reach every replica): SyncNone or
	// SyncNATS, the model of the NATS sync. Ignored with one replica.
	Sync Sync
	// SyncDelay is SyncNATS's publish-to-apply latency in virtual time
	// (0: applied at once). At most MaxSyncDelay.
	SyncDelay time.Duration
	// NoTurns turns off the replicas' turns in a burst (routing/burst),
	// as serve's sync.turns: false: each replica then decides at once,
	// blind to its peers' simultaneous decisions (the baseline for the
	// turns; bench --no-turns).
	NoTurns bool
	// ScrapeInterval is how often the workers' load (waiting and running
	// requests, KV usage) reaches the engines, as serve's --scrape-interval
	// (1 s there). 0: after every change of a worker, an oracle no scraper
	// matches. A stale load leaves the engines with what they count
	// themselves (their in-flight decisions), which is what replicas
	// share.
	ScrapeInterval time.Duration
	// SLO tunes the latency-objective rule (routing/slo) applied to
	// requests whose Hints carry a TTFTObjective; the zero value takes
	// its defaults.
	SLO slo.Config
	// Roles gives each worker its role (nil: all RoleBoth; otherwise one
	// per worker). With prefill-role workers and PD set, the engines
	// disaggregate (see the package doc, "Prefill/decode
	// disaggregation").
	Roles []routing.Role
	// PD is the engines' disaggregation config (nil: none, every request
	// aggregated whatever the roles).
	PD *pd.Config
	// Transfer prices the KV transfer from a prefill worker to a decode
	// worker; zero fields take the defaults.
	Transfer Transfer
	// observe, when set (tests), is called at the P/D steps of a request:
	// "handoff" (its prefill leg ended), "land" (its KV transfer ended)
	// and "first" (its first token reached the response path).
	observe func(s *simulation, a *active, step string)
	// rogue, when set (tests), is a forging peer of the replicas; probe,
	// when set (tests), is called before request i arrives (after the
	// rogue's part).
	rogue *rogue
	probe func(s *simulation, i int)
	// Progress, when set, is called on Run's goroutine with the number of
	// requests routed so far, every ProgressEvery arrivals and after the
	// last one. It must return quickly.
	Progress func(arrived int)
}

// ProgressEvery is how many arrivals pass between two Config.Progress
// calls.
const ProgressEvery = 64

// Configuration errors.
var (
	ErrNoWorkers      = errors.New("sim: no workers")
	ErrWorkerConfig   = errors.New("sim: invalid worker config")
	ErrSchedule       = errors.New("sim: invalid schedule")
	ErrInvalidRequest = errors.New("sim: invalid request")
)

// withDefaults fills zero fields and checks the rest.
func (c WorkerConfig) withDefaults(i int) (WorkerConfig, error) {
	bad := func(what string, v any) error {
		return fmt.Errorf("%w: worker %d: %s %v", ErrWorkerConfig, i, what, v)
	}
	switch {
	case c.KVBlocks < 0:
		return c, bad("negative KVBlocks", c.KVBlocks)
	case c.BlockSize < 0:
		return c, bad("negative BlockSize", c.BlockSize)
	case c.MaxNumSeqs < 0:
		return c, bad("negative MaxNumSeqs", c.MaxNumSeqs)
	case c.MaxBatchedTokens < 0:
		return c, bad("negative MaxBatchedTokens", c.MaxBatchedTokens)
	case c.Speed < 0 || math.IsNaN(c.Speed) || math.IsInf(c.Speed, 0):
		return c, bad("speed must be > 0, got", c.Speed)
	case c.CPUBlocks < 0:
		return c, bad("negative CPUBlocks", c.CPUBlocks)
	case c.CPUReloadTokensPerSec < 0 || math.IsNaN(c.CPUReloadTokensPerSec) || math.IsInf(c.CPUReloadTokensPerSec, 0):
		return c, bad("CPU reload bandwidth must be > 0, got", c.CPUReloadTokensPerSec)
	}
	if c.CPUReloadTokensPerSec == 0 {
		c.CPUReloadTokensPerSec = DefaultCPUReloadTokensPerSec
	}
	if c.KVBlocks == 0 {
		c.KVBlocks = DefaultKVBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxNumSeqs == 0 {
		c.MaxNumSeqs = DefaultMaxNumSeqs
	}
	if c.MaxBatchedTokens == 0 {
		c.MaxBatchedTokens = DefaultMaxBatchedTokens
	}
	if c.Speed == 0 {
		c.Speed = 1
	}
	if c.Prefill == nil {
		c.Prefill = MockerPrefill
	}
	if c.Decode == nil {
		c.Decode = MockerDecode
	}
	return c, nil
}

// validate checks cfg and reqs and returns the workers' configs with
// defaults.
func validate(cfg *Config, reqs []Request) ([]WorkerConfig, error) {
	if len(cfg.Workers) == 0 {
		return nil, ErrNoWorkers
	}
	wcs := make([]WorkerConfig, len(cfg.Workers))
	for i, wc := range cfg.Workers {
		var err error
		if wcs[i], err = wc.withDefaults(i); err != nil {
			return nil, err
		}
	}
	if err := validateReplicas(cfg); err != nil {
		return nil, err
	}
	if cfg.Roles != nil && len(cfg.Roles) != len(wcs) {
		return nil, fmt.Errorf("%w: %d roles for %d workers", ErrWorkerConfig, len(cfg.Roles), len(wcs))
	}
	if cfg.PD != nil {
		if err := cfg.PD.Validate(); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	if err := cfg.Transfer.validate(); err != nil {
		return nil, err
	}
	if cfg.RouterBlockSize < 0 {
		return nil, fmt.Errorf("%w: negative RouterBlockSize %d", ErrWorkerConfig, cfg.RouterBlockSize)
	}
	if cfg.ScrapeInterval < 0 || cfg.ScrapeInterval > maxScrapeInterval {
		return nil, fmt.Errorf("%w: scrape interval %v (want 0 to %v)", ErrWorkerConfig, cfg.ScrapeInterval, maxScrapeInterval)
	}
	var last time.Duration
	for i, ch := range cfg.Schedule {
		switch {
		case ch.Worker < 0 || ch.Worker >= len(wcs):
			return nil, fmt.Errorf("%w: change %d: worker %d of %d", ErrSchedule, i, ch.Worker, len(wcs))
		case ch.At < 0:
			return nil, fmt.Errorf("%w: change %d: negative time %v", ErrSchedule, i, ch.At)
		case ch.Speed < 0 || math.IsNaN(ch.Speed) || math.IsInf(ch.Speed, 0):
			return nil, fmt.Errorf("%w: change %d: speed must be >= 0 (0 stops), got %v", ErrSchedule, i, ch.Speed)
		case ch.At < last:
			return nil, fmt.Errorf("%w: change %d: not sorted by time", ErrSchedule, i)
		}
		last = ch.At
	}
	last = 0
	for i := range reqs {
		r := &reqs[i]
		switch {
		case r.Arrival < 0:
			return nil, fmt.Errorf("%w: request %d: negative arrival %v", ErrInvalidRequest, i, r.Arrival)
		case r.Arrival < last:
			return nil, fmt.Errorf("%w: request %d: not sorted by arrival", ErrInvalidRequest, i)
		case len(r.Tokens) == 0:
			return nil, fmt.Errorf("%w: request %d: empty prompt", ErrInvalidRequest, i)
		case r.OutputLen < 1:
			return nil, fmt.Errorf("%w: request %d: output length %d < 1", ErrInvalidRequest, i, r.OutputLen)
		}
		last = r.Arrival
	}
	return wcs, nil
}
