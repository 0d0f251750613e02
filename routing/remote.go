package routing

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/slots"
)

// This file holds the engine's side of active-active replicas: what a
// decision shares with peer replicas ([Decision.Share],
// [Decision.ShareOutcome]) and how a peer's decisions and outcomes are
// applied here ([Engine.StartRemote], [Engine.LearnRemote]). The transport
// (routing/sync) decides when to call them; nothing here does I/O.

// Limits of a peer's decision. They match the sync protocol's limits
// (routing/sync/wire), so a value the wire accepts is accepted here; a
// caller that builds a RemoteStart by hand meets the same bounds.
const (
	// MaxRemoteBlocks bounds the block keys of one remote decision.
	MaxRemoteBlocks = 16384
	// MaxRemoteString bounds a remote decision's or outcome's strings
	// (prefix id, tenant, model) in bytes; [Decision.Share] leaves out a
	// longer one.
	MaxRemoteString = 512
	// MaxRemoteTokens bounds a remote decision's prompt tokens and an
	// outcome's token counts (the largest body kvbandit accepts holds far
	// fewer).
	MaxRemoteTokens = 1 << 24
	// MaxRemoteBlockSize bounds a remote decision's block size in tokens.
	MaxRemoteBlockSize = 1 << 16

	// DefaultMaxRemoteDecisions is Options.MaxRemoteDecisions' default:
	// 64 peers each with 1024 requests in flight (--max-inflight's
	// default).
	DefaultMaxRemoteDecisions = 1 << 16
	// DefaultRemoteBlockBudget is Options.RemoteBlockBudget's default:
	// 4 Mi block keys, 32 MiB.
	DefaultRemoteBlockBudget = 1 << 22
)

var (
	// ErrUnknownEndpoint: a peer's decision or outcome names an endpoint,
	// or a data-parallel rank of it, that is not in the current endpoint
	// set. Nothing is recorded.
	ErrUnknownEndpoint = errors.New("unknown endpoint")
	// ErrInvalidRemote: a peer's decision or outcome carries a value out
	// of range (too many blocks, a negative count, an unknown kind).
	// Nothing is recorded.
	ErrInvalidRemote = errors.New("invalid remote decision")
	// ErrRemoteLimit: the engine already holds Options.MaxRemoteDecisions
	// peers' decisions, or Options.RemoteBlockBudget block keys for them.
	// Nothing is recorded.
	ErrRemoteLimit = errors.New("too many remote decisions")
)

// RemoteStart is a decision made by a peer replica, as much of it as this
// replica needs to carry its load ([Engine.StartRemote]): the slot
// tracker's active blocks and prefill tokens, the approximate index's
// insert, and the session state (prefix affinity) the policy records when
// it decides. [Decision.Share] makes one from a local decision.
type RemoteStart struct {
	// Endpoint and DPRank are the chosen endpoint and data-parallel rank
	// (-1 for a single-rank endpoint).
	Endpoint EndpointKey
	DPRank   int
	// BlockSize is the block size of Blocks, in tokens.
	BlockSize int
	// Blocks are the prompt's chained block keys (routing/kvindex) in the
	// chosen endpoint's block size. StartRemote retains the slice: the
	// caller must not modify it afterwards.
	Blocks []uint64
	// ISL is the prompt length in tokens.
	ISL int
	// Overlap is the number of leading blocks the deciding replica found
	// cached on the endpoint.
	Overlap int
	// ExpectedDecodeBlocks is the blocks the response is expected to
	// generate, from the request's output-length hint or max_tokens; 0
	// when unknown. It is informative: the slot tracker counts prompt
	// blocks only, so StartRemote does not use it.
	ExpectedDecodeBlocks int
	// Model is the request's model.
	Model ModelName

	// The request's session: the prefix id and tenant key the prefix
	// state (routing/prefixstate keys them with NewKey, on every replica
	// alike), and the hints the policies record with it. Empty PrefixID:
	// no session.
	PrefixID      string
	Tenant        string
	TotalRequests int
	OSL           Level
	OSLTokens     int
	IAT           Level
	MaxTokens     int
}

// RemoteOutcome is the outcome of a peer replica's decision, with the
// decision-time numbers a policy's learning needs ([Engine.LearnRemote]).
// [Decision.ShareOutcome] makes one from a local decision.
type RemoteOutcome struct {
	// Endpoint and DPRank are the endpoint and rank the peer chose.
	Endpoint EndpointKey
	DPRank   int
	// Outcome is what happened. Served, when set and not Endpoint, is the
	// endpoint the data plane really used; it must be in this replica's
	// endpoint set too. ServedUnknown is ignored (set by LearnRemote).
	Outcome
	// BlockSize, ISL and Overlap are the decision's block size, prompt
	// tokens and cached blocks; QueuedPrefillTokens the prompt tokens of
	// the endpoint rank's in-flight requests at decision time, as the
	// deciding replica saw them (its own and its peers'); OSL the
	// request's output-length hint.
	BlockSize           int
	ISL                 int
	Overlap             int
	QueuedPrefillTokens int64
	OSL                 Level
	// PrefixID, Tenant and Model describe the request. No policy learns
	// anything keyed by them at outcome time today (affinity is recorded
	// when a decision is made: [Engine.StartRemote]); they are carried for
	// policies and logs that do.
	PrefixID string
	Tenant   string
	Model    ModelName
	// Received is when this replica learnt the outcome, on the engine's
	// clock (set by LearnRemote): peers' clocks are never used.
	Received time.Time
}

// RemoteStarter is implemented by policies that record state when they
// commit a decision, beyond the engine's slot and index accounting: the
// prefix (session) state of hint-aware policies. StartRemote records what
// the policy's Choose would have recorded had it chosen s.Endpoint for req
// itself (spending the session's reuse budget and pinning the session to
// the endpoint), so that the session's next request follows it on this
// replica too. req is built from s (model, tenant, session hints, ISL as
// TokenCount); it is only called when s.PrefixID is set. Implementations
// must be safe for concurrent use with Choose and must not block.
type RemoteStarter interface {
	StartRemote(req *Request, s *RemoteStart)
}

// RemoteLearner is implemented by policies that learn from outcomes.
// LearnRemote applies a peer's outcome as Done would have applied the
// same outcome of a local decision on o.Endpoint, from o's decision-time
// numbers instead of the decision's private state; each implementation
// documents what differs. The engine has checked o.Endpoint, o.DPRank and
// o.Served against its endpoint set. Implementations must be safe for
// concurrent use and must not block.
type RemoteLearner interface {
	LearnRemote(o *RemoteOutcome)
}

// shareInfo is what a committed decision keeps for Share and
// ShareOutcome. It is filled without allocating: keys is the decision's
// block key slice (the one the slot holds), strings are the request's.
type shareInfo struct {
	keys   []uint64
	bs     int
	isl    int
	queued int64
	req    requestInfo
}

// requestInfo is the part of a Request a peer replica needs.
type requestInfo struct {
	model         ModelName
	tenant        string
	prefixID      string
	totalRequests int
	oslTokens     int
	maxTokens     int
	osl, iat      Level
}

func (r *Request) shared() requestInfo {
	return requestInfo{
		model: r.Model, tenant: r.Tenant, prefixID: r.Hints.PrefixID, totalRequests: r.Hints.TotalRequests,
		oslTokens: r.Hints.OSLTokens, maxTokens: r.MaxTokens, osl: r.Hints.OSL, iat: r.Hints.IAT,
	}
}

// Number is the decision's number on this replica (its ID in base 36),
// unique per engine; 0 for a decision that was not committed.
func (d *Decision) Number() uint64 { return d.num }

// Share returns what a peer replica needs to carry this decision's load
// and session ([Engine.StartRemote]). Blocks is the decision's own block
// key slice, shared: neither side may modify it. A tenant, prefix id or
// model longer than [MaxRemoteString] is left out (a long tenant or prefix
// id drops the session: the other replicas then give the session no
// affinity, never someone else's); the request's prefix id is already
// bounded when it comes from the routing hints. Share does not allocate.
func (d *Decision) Share() RemoteStart {
	sh := &d.share
	r := &sh.req
	s := RemoteStart{
		Endpoint: d.Endpoint, DPRank: d.DPRank, BlockSize: sh.bs, Blocks: sh.keys, ISL: sh.isl, Overlap: d.Overlap,
		ExpectedDecodeBlocks: expectedDecodeBlocks(r.oslTokens, r.maxTokens, sh.bs),
	}
	if len(r.model) <= MaxRemoteString {
		s.Model = r.model
	}
	if r.prefixID != "" && len(r.prefixID) <= MaxRemoteString && len(r.tenant) <= MaxRemoteString {
		s.PrefixID, s.Tenant, s.TotalRequests = r.prefixID, r.tenant, r.totalRequests
		s.OSL, s.OSLTokens, s.IAT, s.MaxTokens = r.osl, r.oslTokens, r.iat, r.maxTokens
	}
	return s
}

// expectedDecodeBlocks is the response's expected blocks from the output
// length hint, else max_tokens; 0 when neither is known.
func expectedDecodeBlocks(oslTokens, maxTokens, bs int) int {
	n := oslTokens
	if n <= 0 {
		n = maxTokens
	}
	if n <= 0 || bs <= 0 {
		return 0
	}
	return min((n+bs-1)/bs, MaxRemoteTokens)
}

// ShareOutcome returns what a peer replica needs to learn from this
// decision's outcome o as the engine handed it to the policy (Deps.OnDone
// receives it so). ok is false when the outcome teaches nothing anywhere:
// it was served by an endpoint outside the set (Outcome.ServedUnknown).
func (d *Decision) ShareOutcome(o Outcome) (ro RemoteOutcome, ok bool) {
	if o.ServedUnknown {
		return RemoteOutcome{}, false
	}
	sh := &d.share
	ro = RemoteOutcome{
		Endpoint: d.Endpoint, DPRank: d.DPRank, Outcome: o,
		BlockSize: sh.bs, ISL: sh.isl, Overlap: d.Overlap, QueuedPrefillTokens: sh.queued, OSL: sh.req.osl,
	}
	if o.Served == d.Endpoint {
		ro.Served = ""
	}
	if len(sh.req.model) <= MaxRemoteString {
		ro.Model = sh.req.model
	}
	if len(sh.req.prefixID) <= MaxRemoteString && len(sh.req.tenant) <= MaxRemoteString {
		ro.PrefixID, ro.Tenant = sh.req.prefixID, sh.req.tenant
	}
	return ro, true
}

// RemoteDecision is a peer replica's decision applied to this engine's
// load accounting. It holds its endpoint rank's slot by pointer, so it
// survives endpoint-set updates as a local decision does, and End stays
// safe after the endpoint left the set.
type RemoteDecision struct {
	// Endpoint and DPRank are where the peer routed the request.
	Endpoint EndpointKey
	DPRank   int

	e         *Engine
	live      *Live
	blocks    int64 // block keys counted in Engine.remoteBlocks
	entry     *slots.Entry
	timer     clock.Timer
	prefilled atomic.Bool
	ended     atomic.Bool
}

// StartRemote applies a peer replica's decision as if this engine had made
// it: it counts the decision in the endpoint's RemoteInFlight, adds its
// blocks and uncached prompt tokens to the chosen rank's slot, inserts its
// blocks into the approximate index when the rank's KV events are not
// trusted (through the same path as a local decision), and lets a policy
// that records session state at decision time ([RemoteStarter]) record it.
//
// s is checked against the current endpoint set: an endpoint or rank not
// in it gives ErrUnknownEndpoint, a value out of bounds ErrInvalidRemote,
// and more open peers' decisions or held block keys than the Options
// allow ErrRemoteLimit; nothing is recorded then. Blocks of another block size than this
// replica's for the endpoint (a worker-reported size one replica has not
// scraped yet) are another key space: their prefill tokens still count,
// their blocks are neither held nor indexed.
//
// The decision is released by [RemoteDecision.End] (the sync layer calls it
// on the peer's End, on snapshot replacement and when the peer's TTL
// expires), or after Options.StaleAfter like a local decision whose Done
// never came. No Deps hook is called (the sync layer must not publish its
// peers' decisions again), and the endpoint's health is not touched.
// StartRemote never blocks; it must not be called after Close.
func (e *Engine) StartRemote(s RemoteStart) (*RemoteDecision, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	st, rs, err := e.rankOf(s.Endpoint, s.DPRank)
	if err != nil {
		return nil, err
	}
	n := int64(len(s.Blocks))
	if open := e.remoteOpen.Add(1); open > int64(e.opts.MaxRemoteDecisions) {
		e.remoteOpen.Add(-1)
		return nil, fmt.Errorf("%w: %d open (max %d)", ErrRemoteLimit, open-1, e.opts.MaxRemoteDecisions)
	}
	if held := e.remoteBlocks.Add(n); held > int64(e.opts.RemoteBlockBudget) {
		e.remoteBlocks.Add(-n)
		e.remoteOpen.Add(-1)
		return nil, fmt.Errorf("%w: %d block keys held, %d more (budget %d)", ErrRemoteLimit, held-n, n, e.opts.RemoteBlockBudget)
	}
	now := e.clk.Now()
	r := &RemoteDecision{Endpoint: st.Key, DPRank: s.DPRank, e: e, live: st.Live, blocks: n}
	st.RemoteInFlight.Add(1)
	keys := s.Blocks
	if s.BlockSize != e.blockSize(st) {
		keys = nil
	}
	if !e.opts.DisableActiveBlocks || s.ISL > 0 {
		held := keys
		if e.opts.DisableActiveBlocks {
			held = nil
		}
		r.entry = rs.slot.Add(held, s.ISL, s.Overlap, s.BlockSize)
	}
	e.insertApprox(rs, s.BlockSize, keys, now)
	if p, ok := e.policy.(RemoteStarter); ok && s.PrefixID != "" {
		p.StartRemote(s.request(), &s)
	}
	r.timer = e.clk.AfterFunc(e.opts.StaleAfter, func() {
		if r.End() {
			e.remoteExpired.Add(1)
		}
	})
	return r, nil
}

// Prefilled reports the remote decision's first token: its prompt tokens
// stop counting as prefill load. Calls after the first, or after End, do
// nothing.
func (r *RemoteDecision) Prefilled() {
	if r == nil || r.ended.Load() || !r.prefilled.CompareAndSwap(false, true) {
		return
	}
	r.entry.Prefilled()
	if r.e.queue != nil {
		r.e.queue.Wake()
	}
}

// End releases the remote decision's load. The first call returns true;
// later calls do nothing and return false. It is safe after the endpoint
// left the endpoint set.
func (r *RemoteDecision) End() bool {
	if r == nil || !r.ended.CompareAndSwap(false, true) {
		return false
	}
	if r.timer != nil {
		r.timer.Stop()
	}
	r.entry.Free()
	r.live.RemoteInFlight.Add(-1)
	r.e.remoteBlocks.Add(-r.blocks)
	r.e.remoteOpen.Add(-1)
	if r.e.queue != nil {
		r.e.queue.Wake()
	}
	return true
}

// FleetInFlight is the endpoint's in-flight decisions as far as this
// replica knows: its own (InFlight) and its peers' (RemoteInFlight). It is
// the load policies read as "in flight" (least_loaded, weighted's queue
// fallback, thompson's pending load), so that every replica sees the
// fleet's load; InFlight alone is this replica's share, which outcomes
// and draining are about.
func (l *Live) FleetInFlight() int64 { return l.InFlight.Load() + l.RemoteInFlight.Load() }

// Ended reports whether End was called (or the stale timer released it).
func (r *RemoteDecision) Ended() bool { return r.ended.Load() }

// RemoteExpired returns how many peers' decisions were released by their
// stale timer (Options.StaleAfter) because no End came.
func (e *Engine) RemoteExpired() int64 { return e.remoteExpired.Load() }

// LearnRemote lets the policy learn from a peer replica's outcome
// ([RemoteLearner]); a policy that learns nothing from outcomes ignores it.
// An endpoint, rank or served endpoint not in the current endpoint set
// gives ErrUnknownEndpoint, a value out of bounds ErrInvalidRemote, and
// nothing is learnt.
//
// Endpoint health (passive ejection) does not learn from peers' outcomes:
// a peer's errors may be its own network's, so health stays a local
// observation. Nor is Deps.OnDone called.
func (e *Engine) LearnRemote(o RemoteOutcome) error {
	if err := o.validate(); err != nil {
		return err
	}
	if _, _, err := e.rankOf(o.Endpoint, o.DPRank); err != nil {
		return err
	}
	if o.Served == o.Endpoint {
		o.Served = ""
	}
	if o.Served != "" {
		if _, ok := e.snap.Load().byKey[o.Served]; !ok {
			return fmt.Errorf("%w: served by %s", ErrUnknownEndpoint, quoteBounded(string(o.Served)))
		}
	}
	o.ServedUnknown = false
	o.Received = e.clk.Now()
	if l, ok := e.policy.(RemoteLearner); ok {
		l.LearnRemote(&o)
	}
	return nil
}

// rankOf returns the endpoint's state and rank for a peer's (endpoint,
// rank): rank -1 for a single-rank endpoint, 0..n-1 for one with n ranks.
func (e *Engine) rankOf(ep EndpointKey, rank int) (*EndpointState, *rankState, error) {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return nil, nil, fmt.Errorf("%w: %s", ErrUnknownEndpoint, quoteBounded(string(ep)))
	}
	n := len(st.ranks)
	switch {
	case n == 1 && rank == -1:
		return st, st.ranks[0], nil
	case n > 1 && rank >= 0 && rank < n:
		return st, st.ranks[rank], nil
	}
	return nil, nil, fmt.Errorf("%w: %s rank %d of %d", ErrUnknownEndpoint, st.Key, rank, n)
}

func (s *RemoteStart) validate() error {
	switch {
	case len(s.Blocks) > MaxRemoteBlocks:
		return fmt.Errorf("%w: %d blocks (max %d)", ErrInvalidRemote, len(s.Blocks), MaxRemoteBlocks)
	case s.BlockSize < 1 || s.BlockSize > MaxRemoteBlockSize:
		return fmt.Errorf("%w: block size %d", ErrInvalidRemote, s.BlockSize)
	case s.ISL < 0 || s.ISL > MaxRemoteTokens:
		return fmt.Errorf("%w: %d prompt tokens", ErrInvalidRemote, s.ISL)
	case s.Overlap < 0 || s.Overlap > len(s.Blocks):
		return fmt.Errorf("%w: overlap %d of %d blocks", ErrInvalidRemote, s.Overlap, len(s.Blocks))
	case s.ExpectedDecodeBlocks < 0 || s.ExpectedDecodeBlocks > MaxRemoteTokens:
		return fmt.Errorf("%w: %d expected decode blocks", ErrInvalidRemote, s.ExpectedDecodeBlocks)
	case len(s.PrefixID) > MaxRemoteString || len(s.Tenant) > MaxRemoteString || len(s.Model) > MaxRemoteString:
		return fmt.Errorf("%w: prefix id, tenant or model over %d bytes", ErrInvalidRemote, MaxRemoteString)
	case s.TotalRequests < 0 || s.OSLTokens < 0 || s.MaxTokens < 0 || s.OSL > LevelHigh || s.IAT > LevelHigh:
		return fmt.Errorf("%w: session hints out of range", ErrInvalidRemote)
	}
	return nil
}

// request is the request a policy's StartRemote sees: the peer's request
// as far as the session goes.
func (s *RemoteStart) request() *Request {
	return &Request{
		Model: s.Model, Tenant: s.Tenant, TokenCount: s.ISL, MaxTokens: s.MaxTokens,
		Hints: Hints{PrefixID: s.PrefixID, TotalRequests: s.TotalRequests, OSL: s.OSL, OSLTokens: s.OSLTokens, IAT: s.IAT},
	}
}

func (o *RemoteOutcome) validate() error {
	switch {
	case o.Kind > OutcomeExpired:
		return fmt.Errorf("%w: outcome kind %d", ErrInvalidRemote, o.Kind)
	case o.Status < 0 || o.Status > 999:
		return fmt.Errorf("%w: status %d", ErrInvalidRemote, o.Status)
	case o.TTFT < 0 || o.Latency < 0:
		return fmt.Errorf("%w: negative duration", ErrInvalidRemote)
	case !tokenCount(o.PromptTokens) || !tokenCount(o.CompletionTokens) || !tokenCount(o.CachedTokens):
		return fmt.Errorf("%w: token counts out of range", ErrInvalidRemote)
	case o.BlockSize < 1 || o.BlockSize > MaxRemoteBlockSize:
		return fmt.Errorf("%w: block size %d", ErrInvalidRemote, o.BlockSize)
	case o.ISL < 0 || o.ISL > MaxRemoteTokens || o.Overlap < 0 || o.Overlap > MaxRemoteBlocks:
		return fmt.Errorf("%w: prompt tokens %d, overlap %d", ErrInvalidRemote, o.ISL, o.Overlap)
	case o.QueuedPrefillTokens < 0 || o.QueuedPrefillTokens > 1<<40:
		return fmt.Errorf("%w: queued prefill tokens %d", ErrInvalidRemote, o.QueuedPrefillTokens)
	case o.OSL > LevelHigh:
		return fmt.Errorf("%w: output length level %d", ErrInvalidRemote, o.OSL)
	case len(o.PrefixID) > MaxRemoteString || len(o.Tenant) > MaxRemoteString || len(o.Model) > MaxRemoteString:
		return fmt.Errorf("%w: prefix id, tenant or model over %d bytes", ErrInvalidRemote, MaxRemoteString)
	}
	return nil
}

// tokenCount reports whether n is a token count an outcome may carry: -1
// (unknown) to MaxRemoteTokens.
func tokenCount(n int) bool { return n >= -1 && n <= MaxRemoteTokens }

// quoteBounded quotes s for an error message, cut to MaxRemoteString
// bytes: peers' values end up in logs.
func quoteBounded(s string) string {
	if len(s) <= MaxRemoteString {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:MaxRemoteString]) + "... (" + strconv.Itoa(len(s)) + " bytes)"
}
