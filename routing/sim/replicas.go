package sim

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/burst"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// This file holds the replicas of a run: R independent routing engines
// (pickers) in front of the one simulated fleet, as R kvbandit serve
// processes behind R Envoys, and the model of what they share.

// Sync is what the replicas of a run share.
type Sync uint8

const (
	// SyncNone: the replicas share nothing but what comes from the
	// workers themselves (scraped load, KV events); each sees only its
	// own decisions, as kvbandit serve without --sync-nats.
	SyncNone Sync = iota
	// SyncNATS models routing/sync over NATS Core (serve --sync-nats):
	// every decision's start ([routing.Decision.Share]), first token and
	// end are applied on every other replica ([engine.Engine.StartRemote],
	// [engine.RemoteDecision.Prefilled], [engine.RemoteDecision.End]),
	// and its outcome learnt ([routing.Decision.ShareOutcome],
	// [engine.Engine.LearnRemote]), Config.SyncDelay of virtual time
	// after it happened. Nothing is lost or reordered (the model has no
	// faults), so snapshots and heartbeats, which only repair losses, are
	// not modelled.
	SyncNATS
)

// String returns the --sync name: "none" or "nats".
func (s Sync) String() string {
	switch s {
	case SyncNone:
		return "none"
	case SyncNATS:
		return "nats"
	}
	return fmt.Sprintf("Sync(%d)", uint8(s))
}

// ParseSync returns the Sync named s ("none" or "nats").
func ParseSync(s string) (Sync, error) {
	switch s {
	case "none":
		return SyncNone, nil
	case "nats":
		return SyncNATS, nil
	}
	return 0, fmt.Errorf("%w: sync %q (want none or nats)", ErrReplicas, s)
}

// Replica limits.
const (
	// MaxReplicas bounds Config.Replicas.
	MaxReplicas = 64
	// MaxSyncDelay bounds Config.SyncDelay.
	MaxSyncDelay = time.Minute
	// DefaultSyncDelay is bench's --sync-delay default: a NATS round trip
	// in one zone plus a short batching window.
	DefaultSyncDelay = 2 * time.Millisecond
)

// ErrReplicas: Config.Replicas, Sync or SyncDelay is out of range.
var ErrReplicas = errors.New("sim: invalid replicas")

func validateReplicas(cfg *Config) error {
	switch {
	case cfg.Replicas < 0 || cfg.Replicas > MaxReplicas:
		return fmt.Errorf("%w: %d replicas (want 1 to %d)", ErrReplicas, cfg.Replicas, MaxReplicas)
	case cfg.Sync > SyncNATS:
		return fmt.Errorf("%w: sync %v", ErrReplicas, cfg.Sync)
	case cfg.SyncDelay < 0 || cfg.SyncDelay > MaxSyncDelay:
		return fmt.Errorf("%w: sync delay %v (want 0 to %v)", ErrReplicas, cfg.SyncDelay, MaxSyncDelay)
	}
	return nil
}

// replica is one picker: its engine, policy and prefix store, and, for
// SyncNATS, its decisions as applied on its peers.
type replica struct {
	idx   int
	eng   *engine.Engine
	close []func()
	// remote holds, by this replica's decision number, the decision as
	// each peer applied it (indexed by peer; nil for itself or when the
	// peer refused it). An entry is made when the start is applied and
	// removed when the end is.
	remote map[uint64][]*engine.RemoteDecision
	// batchEnd is when this replica's open batch of sync items is
	// published (-1: none open).
	batchEnd time.Duration
}

// replicaSeed is replica i's seed: the run's seed for the first replica
// (so that one replica reproduces a run without replicas draw for draw),
// an independent SplitMix64 stream for the others. Seed 0 (random) stays
// 0.
func replicaSeed(seed int64, i int) int64 {
	if seed == 0 || i == 0 {
		return seed
	}
	z := uint64(seed) ^ uint64(i)*0xd1b54a32d192ed03
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	z ^= z >> 31
	if z == 0 {
		z = 1
	}
	return int64(z)
}

// entrySeed seeds the choice of each request's entry replica.
func entrySeed(seed int64) int64 { return replicaSeed(seed, MaxReplicas+1) }

// newReplica builds replica i: its own prefix store (the hint-aware
// policies share it, as serve wires them), policy, random source and
// engine, all on the simulation's virtual clock.
func (s *simulation) newReplica(cfg *Config, i, blockSize int) (*replica, error) {
	r := &replica{idx: i, batchEnd: -1}
	rnd := routing.NewRand(replicaSeed(cfg.Seed, i))
	store, err := prefixstate.New(prefixstate.Config{}, s.vc)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	r.close = append(r.close, store.Close)
	pol, err := policy.Builtin().New(cfg.Policy, policy.Deps{Logger: s.log, Clock: s.vc, Rand: rnd, Config: cfg.Policies, Prefixes: store})
	if err != nil {
		r.shut()
		return nil, fmt.Errorf("sim: %w", err)
	}
	if c, ok := pol.(interface{ Close() error }); ok {
		r.close = append(r.close, func() { _ = c.Close() })
	}
	gate, err := slo.New(cfg.SLO)
	if err != nil {
		r.shut()
		return nil, fmt.Errorf("sim: %w", err)
	}
	deps := engine.Deps{Logger: s.log, Clock: s.vc, Rand: rnd, Gate: gate}
	if cfg.PD != nil {
		dis, err := pd.New(*cfg.PD)
		if err != nil {
			r.shut()
			return nil, fmt.Errorf("sim: %w", err)
		}
		deps.PD = dis
	}
	if cfg.Sync == SyncNATS && max(cfg.Replicas, 1) > 1 {
		r.remote = make(map[uint64][]*engine.RemoteDecision)
		deps.OnDecision = func(_ *routing.Request, d *routing.Decision) { s.shareStart(r, d) }
		deps.OnFirst = func(d *routing.Decision) { s.shareFirst(r, d) }
		deps.OnDone = func(d *routing.Decision, o routing.Outcome) { s.shareDone(r, d, o) }
	}
	opts := engine.Options{BlockSize: blockSize, SyncIndex: true, StaleAfter: staleAfter, TierWeights: cfg.TierWeights, ExternalTurns: true}
	if cfg.Sync == SyncNATS && max(cfg.Replicas, 1) > 1 && !cfg.NoTurns {
		opts.Burst = burst.Config{Delay: s.syncDelay}
	}
	eng, err := engine.New(pol, opts, deps)
	if err != nil {
		r.shut()
		return nil, fmt.Errorf("sim: %w", err)
	}
	eng.SetReplicas(i, max(cfg.Replicas, 1))
	r.eng = eng
	r.close = append(r.close, eng.Close)
	return r, nil
}

// shut closes the engine, then the policy, then the store.
func (r *replica) shut() {
	for i := len(r.close) - 1; i >= 0; i-- {
		r.close[i]()
	}
	r.close = nil
}

// entry picks the replica request i enters through: at random (seeded)
// with several, without drawing with one.
func (s *simulation) entry() *replica {
	if len(s.reps) == 1 {
		return s.reps[0]
	}
	return s.reps[s.entryRand.IntN(len(s.reps))]
}

// publish counts one sync item of replica from and applies it on the
// peers (apply) SyncDelay later on the virtual clock; at once for a zero
// delay. Items of one replica apply in the order they were published.
//
// Messages are counted as a batching publisher would send them: the first
// item opens a batch that takes every item of the next SyncDelay (the
// items published at the same instant with a zero delay) and goes out as
// one message on the pool's subject, whatever the number of peers.
func (s *simulation) publish(from *replica, apply func()) {
	now := s.vc.Now().Sub(epoch)
	s.res.SyncItems++
	if now > from.batchEnd {
		s.res.SyncMessages++
		from.batchEnd = now + s.syncDelay
	}
	if s.syncDelay == 0 {
		apply()
		return
	}
	s.vc.AfterFunc(s.syncDelay, apply)
}

// shareStart publishes a committed decision's start: its peers carry its
// load, index its blocks and record its session.
func (s *simulation) shareStart(from *replica, d *routing.Decision) {
	n, st := d.Number(), d.Share()
	s.publish(from, func() {
		rds := make([]*engine.RemoteDecision, len(s.reps))
		for _, p := range s.reps {
			if p == from {
				continue
			}
			rd, err := p.eng.StartRemote(st)
			if err != nil {
				s.syncError(from, p, err)
				continue
			}
			rds[p.idx] = rd
		}
		from.remote[n] = rds
	})
}

// shareFirst publishes a decision's first token: its prompt stops
// counting as prefill load on the peers.
func (s *simulation) shareFirst(from *replica, d *routing.Decision) {
	n := d.Number()
	s.publish(from, func() {
		for _, rd := range from.remote[n] {
			rd.Prefilled()
		}
	})
}

// shareDone publishes a decision's end (its peers release its load) and
// its outcome (they learn from it).
func (s *simulation) shareDone(from *replica, d *routing.Decision, o routing.Outcome) {
	n := d.Number()
	s.publish(from, func() {
		for _, rd := range from.remote[n] {
			rd.End()
		}
		delete(from.remote, n)
	})
	ro, ok := d.ShareOutcome(o)
	if !ok {
		return
	}
	ro.Peer = replicaID(from.idx) // as routing/sync sets it from the message
	s.publish(from, func() {
		for _, p := range s.reps {
			if p == from {
				continue
			}
			if err := p.eng.LearnRemote(ro); err != nil {
				s.syncError(from, p, err)
			}
		}
	})
}

// replicaID is replica i's id as its peers know it (serve's --replica-id).
func replicaID(i int) string { return "replica-" + strconv.Itoa(i) }

func (s *simulation) syncError(from, to *replica, err error) {
	s.res.SyncErrors++
	s.log.Debug("sync item refused", "from", from.idx, "to", to.idx, "err", err)
}

// flushSync delivers the sync items still under way at the end of a run
// and counts the decisions left applied on peers.
func (s *simulation) flushSync() {
	if s.syncDelay > 0 && len(s.reps) > 1 {
		s.vc.Step(s.syncDelay)
	}
	for _, r := range s.reps {
		s.res.SyncOpen += len(r.remote)
	}
}

// rogue is a test's forging peer: a replica id none of the run's replicas
// has, whose outcomes every replica learns (as an authenticated peer's
// would be) and which may leave.
type rogue struct {
	// At request From it sends Rounds forged outcomes per worker (a 1 µs
	// TTFT on worker Fast, 4,000 s on the others); at request Leave
	// (when above From) it leaves and every replica forgets it
	// (Engine.ForgetPeer, as routing/sync does for a peer gone silent).
	From, Leave, Rounds, Fast int
}

const rogueID = "rogue"

// forge runs the rogue's part before request i arrives.
func (s *simulation) forge(i int) {
	g := s.rogue
	switch {
	case g == nil:
	case i == g.From:
		for range g.Rounds {
			for w, k := range s.keys {
				ttft := 4000 * time.Second
				if w == g.Fast {
					ttft = time.Microsecond
				}
				o := routing.RemoteOutcome{Endpoint: k, DPRank: -1, BlockSize: s.blockSize, ISL: 1024, Peer: rogueID,
					Outcome: routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: ttft, Latency: ttft, CompletionTokens: 1}}
				for _, r := range s.reps {
					if err := r.eng.LearnRemote(o); err != nil {
						s.res.SyncErrors++
					}
				}
			}
		}
	case i == g.Leave && g.Leave > g.From:
		for _, r := range s.reps {
			r.eng.ForgetPeer(rogueID)
		}
	}
}
