package engine

import (
	"github.com/kvbandit/kvbandit/routing/burst"

	"github.com/kvbandit/kvbandit/routing"

	"log/slog"
	"time"

	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// Options are the engine's behaviour switches. The zero value is usable:
// zero fields take the defaults below.
type Options struct {
	// Fallbacks is the number of extra endpoints to append to decisions.
	Fallbacks int
	// PassThroughUnknownModels routes a model no endpoint declares to any
	// endpoint instead of failing with ErrModelNotFound.
	PassThroughUnknownModels bool
	// BlockSize is the KV block size in tokens for endpoints that do not
	// report their own (--router-block-size, default 16).
	BlockSize int
	// DisableActiveBlocks turns off the in-flight block accounting
	// (--no-router-track-active-blocks): no request blocks are held.
	DisableActiveBlocks bool
	// StaleAfter releases a decision whose Done never came
	// (default 5 minutes).
	StaleAfter time.Duration
	// Index configures the KV index's approximate mode (TTL, cap, pruning).
	Index kvindex.Options
	// Admission configures the admission queue (off unless Threshold > 0).
	Admission admission.Config
	// DefaultMaxBatchedTokens is an endpoint's prefill capacity when
	// discovery does not say (default 8192).
	DefaultMaxBatchedTokens int
	// SyncIndex applies approximate index inserts inside Pick instead of on
	// the engine's index goroutine. The virtual-time simulator and tests
	// use it for determinism; serving leaves it off so that Pick never
	// takes the index's writer lock.
	SyncIndex bool
	// Ejection configures passive (outcomes) and active (scrapes)
	// ejection of unhealthy endpoints.
	Ejection EjectionOptions
	// AdapterRetention is how long a LoRA adapter reported by an
	// endpoint's worker keeps routing its model there after the worker
	// last reported it (default 10 minutes; negative: only the latest
	// report counts).
	AdapterRetention time.Duration
	// MaxRemoteDecisions bounds the peer replicas' decisions open at once
	// ([Engine.StartRemote]; default DefaultMaxRemoteDecisions), and
	// RemoteBlockBudget the block keys they hold (default
	// DefaultRemoteBlockBudget). Beyond either, StartRemote refuses with
	// ErrRemoteLimit: the sync layer's TTLs normally keep far below.
	MaxRemoteDecisions int
	RemoteBlockBudget  int
	// TierWeights price lower-tier (CPU, disk) cache hits for the policies
	// (router.tier_weights; zero: DefaultTierWeights).
	TierWeights routing.TierWeights
	// MaxInsertBlocks bounds the leading blocks of one prompt that go
	// into the approximate index (default DefaultMaxInsertBlocks; negative:
	// no bound). Deeper blocks are not recorded, so overlap is credited up
	// to it.
	MaxInsertBlocks int
	// InsertBlocksPerSecond bounds the blocks all approximate inserts add
	// per second of the engine's clock, with a burst of one second's worth
	// (default DefaultInsertBlocksPerSecond; negative: no bound). A prompt
	// beyond the budget has only its leading blocks that fit inserted (none
	// when it is spent), and the rest are counted (InsertBlocksLimited):
	// a burst of distinct prompts then cannot push the table to its cap and
	// into pruning.
	InsertBlocksPerSecond int
	// InsertTokensPerRank bounds, in the same way, the tokens (blocks ×
	// block size) approximate inserts add per second for one rank (default
	// DefaultInsertTokensPerRank; negative: no bound). A rank cannot have
	// cached more than it prefilled, and no engine rank prefills much beyond
	// the default a second, so blocks over it describe cache the rank never
	// built.
	InsertTokensPerRank int
	// Burst gives decisions their turns in a burst across the pool's
	// replicas (routing/burst; [Engine.SetReplicas] says this replica's
	// rank): Burst.Delay is the sync delay, how long after a decision the
	// peers have applied it. Zero (a lone replica): off.
	Burst burst.Config
	// ExternalTurns: the caller waits for a decision's turn itself
	// ([Engine.Turn], then Pick at that time), and Pick never waits. The
	// virtual-time simulator sets it.
	ExternalTurns bool
}

// Defaults for [Options].
const (
	DefaultStaleAfter       = 5 * time.Minute
	DefaultMaxBatchedTokens = 8192
	// DefaultMaxInsertBlocks is 128k tokens at the default block size.
	DefaultMaxInsertBlocks = 8192
	// DefaultInsertBlocksPerSecond is 1/16 of the index's default cap
	// (kvindex.DefaultMaxEntries) per second.
	DefaultInsertBlocksPerSecond = 1 << 16
	// DefaultInsertTokensPerRank is 65,536 tokens a second (4096 blocks of
	// 16), above the prefill throughput of one engine rank serving the
	// models a router is put in front of (an 8B model's prefill costs about
	// 16 GFLOP a token: some 40k tokens a second on an H100 at a realistic
	// 700 TFLOP/s).
	DefaultInsertTokensPerRank = 1 << 16
	// DefaultMaxRemoteDecisions is Options.MaxRemoteDecisions' default:
	// 64 peers each with 1024 requests in flight (--max-inflight's
	// default).
	DefaultMaxRemoteDecisions = 1 << 16
	// DefaultRemoteBlockBudget is Options.RemoteBlockBudget's default:
	// 4 Mi block keys, 32 MiB.
	DefaultRemoteBlockBudget = 1 << 22
)

func (o *Options) defaults() {
	if o.BlockSize <= 0 {
		o.BlockSize = routing.DefaultBlockSize
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = DefaultStaleAfter
	}
	if o.DefaultMaxBatchedTokens <= 0 {
		o.DefaultMaxBatchedTokens = DefaultMaxBatchedTokens
	}
	if o.AdapterRetention == 0 {
		o.AdapterRetention = DefaultAdapterRetention
	}
	if o.MaxRemoteDecisions <= 0 {
		o.MaxRemoteDecisions = DefaultMaxRemoteDecisions
	}
	if o.RemoteBlockBudget <= 0 {
		o.RemoteBlockBudget = DefaultRemoteBlockBudget
	}
	if o.MaxInsertBlocks == 0 {
		o.MaxInsertBlocks = DefaultMaxInsertBlocks
	}
	if o.InsertBlocksPerSecond == 0 {
		o.InsertBlocksPerSecond = DefaultInsertBlocksPerSecond
	}
	if o.InsertTokensPerRank == 0 {
		o.InsertTokensPerRank = DefaultInsertTokensPerRank
	}
	o.TierWeights = o.TierWeights.OrDefault()
	o.Ejection.defaults()
}

// Deps are the engine's injected dependencies. Nil fields get defaults.
type Deps struct {
	Logger *slog.Logger
	Clock  clock.Clock
	Rand   *routing.Rand
	// OnDecision, if set, is called after each committed pick.
	OnDecision func(*routing.Request, *routing.Decision)
	// OnDone, if set, is called after each Done with the outcome.
	OnDone func(*routing.Decision, routing.Outcome)
	// OnFirst, if set, is called when a committed decision's first token
	// arrives (the first Decision.Prefilled before Done).
	OnFirst func(*routing.Decision)
	// OnTimings, if set, receives the wall-clock cost of each committed
	// decision's phases (measured with the monotonic clock, not Clock:
	// this is routing overhead, not simulated time).
	OnTimings func(Timings)
	// Gate, if set, narrows the candidates of requests with a TTFT
	// objective before the policy chooses.
	Gate *slo.Gate
	// PD, if set, disaggregates requests in pools with prefill-role
	// endpoints; nil ignores roles.
	PD *pd.Decider
}

// Timings is the routing overhead of one decision, by phase.
type Timings struct {
	// Hash is computing the prompt's block keys.
	Hash time.Duration
	// HashedBlocks is how many block keys the engine hashed (0 when it
	// used the request's Keys).
	HashedBlocks int
	// Lookup is the KV index and in-flight walks for every candidate.
	Lookup time.Duration
	// Score is the policy's Choose.
	Score time.Duration
	// Total is the whole Pick (without admission waiting).
	Total time.Duration
}
