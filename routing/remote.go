package routing

import (
	"errors"
	"fmt"
	"time"
)

// This file holds the vocabulary of active-active replicas: what a peer
// replica's decision and outcome carry, and their bounds. The engine
// applies them (routing/engine: StartRemote, LearnRemote); the transport
// (routing/sync) decides when.

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

	// PrefillEndpoint and PrefillDPRank are a disaggregated decision's
	// prefill endpoint and rank (routing/pd), "" for an aggregated one;
	// PrefillCached is the prompt tokens that endpoint had cached. The
	// prefill endpoint then carries the prompt's prefill until the first
	// token, and Endpoint only its blocks ([Engine.StartRemote]).
	PrefillEndpoint EndpointKey
	PrefillDPRank   int
	PrefillCached   int

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
	// Peer is the replica id the outcome came from (set by the
	// transport; empty: unknown). Policies that keep peers' teaching apart
	// ([PeerForgetter]) key it by Peer. At most MaxRemoteString bytes.
	Peer string
}

// Validate checks a peer's decision against the limits above (errors
// wrap ErrInvalidRemote).
func (s *RemoteStart) Validate() error {
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
	case len(s.PrefixID) > MaxRemoteString || len(s.Tenant) > MaxRemoteString || len(s.Model) > MaxRemoteString || len(s.PrefillEndpoint) > MaxRemoteString:
		return fmt.Errorf("%w: prefix id, tenant, model or prefill endpoint over %d bytes", ErrInvalidRemote, MaxRemoteString)
	case s.PrefillCached < 0 || s.PrefillCached > MaxRemoteTokens || (s.PrefillEndpoint == "" && (s.PrefillCached != 0 || s.PrefillDPRank > 0)):
		return fmt.Errorf("%w: prefill cached tokens %d, rank %d (prefill endpoint %q)", ErrInvalidRemote, s.PrefillCached, s.PrefillDPRank, s.PrefillEndpoint)
	case s.TotalRequests < 0 || s.OSLTokens < 0 || s.MaxTokens < 0 || s.OSL > LevelHigh || s.IAT > LevelHigh:
		return fmt.Errorf("%w: session hints out of range", ErrInvalidRemote)
	}
	return nil
}

// SessionRequest is the request a policy's StartRemote sees: the peer's
// request as far as the session goes.
func (s *RemoteStart) SessionRequest() *Request {
	return &Request{
		Model: s.Model, Tenant: s.Tenant, TokenCount: s.ISL, MaxTokens: s.MaxTokens,
		Hints: Hints{PrefixID: s.PrefixID, TotalRequests: s.TotalRequests, OSL: s.OSL, OSLTokens: s.OSLTokens, IAT: s.IAT},
	}
}

// Validate checks a peer's outcome against the limits above (errors
// wrap ErrInvalidRemote).
func (o *RemoteOutcome) Validate() error {
	switch {
	case o.Kind > LastOutcomeKind:
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
	case len(o.PrefixID) > MaxRemoteString || len(o.Tenant) > MaxRemoteString || len(o.Model) > MaxRemoteString || len(o.Peer) > MaxRemoteString:
		return fmt.Errorf("%w: prefix id, tenant, model or peer over %d bytes", ErrInvalidRemote, MaxRemoteString)
	}
	return nil
}

// tokenCount reports whether n is a token count an outcome may carry: -1
// (unknown) to MaxRemoteTokens.
func tokenCount(n int) bool { return n >= -1 && n <= MaxRemoteTokens }
