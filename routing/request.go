package routing

import (
	"errors"
	"net/netip"
	"strings"
	"time"
)

// Level is a coarse hint level (output length, inter-arrival time).
type Level uint8

// Hint levels. The zero value means "not given"; parsers map missing and
// unknown values to LevelMedium as the reference router does.
const (
	LevelUnset Level = iota
	LevelLow
	LevelMedium
	LevelHigh
)

// String returns LOW, MEDIUM, HIGH or "" for LevelUnset.
func (l Level) String() string {
	switch l {
	case LevelLow:
		return "LOW"
	case LevelMedium:
		return "MEDIUM"
	case LevelHigh:
		return "HIGH"
	}
	return ""
}

// Hints are the client's routing hints (x-prefix-* headers or nvext).
type Hints struct {
	// PrefixID groups requests that share a prefix (an agent session).
	// Empty means a one-shot request with no reuse budget.
	PrefixID string
	// TotalRequests is the announced number of requests in the prefix
	// group; 0 means unknown.
	TotalRequests int
	// OSL is the expected output length level; OSLTokens the raw number
	// when one was given.
	OSL       Level
	OSLTokens int
	// IAT is the expected inter-arrival level; IATMillis the raw number.
	IAT       Level
	IATMillis int
	// Priority: higher is more urgent, below 0 is sheddable.
	Priority int
	// HasPriority is set when a priority was given.
	HasPriority bool
	// LatencySensitivity is the FCFS head start in seconds when no
	// priority is given.
	LatencySensitivity float64
	// TTFTObjective is the request's time-to-first-token objective
	// (x-slo-ttft-ms, nvext, or its InferenceObjective); 0 means none.
	TTFTObjective time.Duration
}

// Sheddable reports whether the request may be rejected under saturation.
func (h Hints) Sheddable() bool { return h.HasPriority && h.Priority < 0 }

// HeadStart is the FCFS queue head start: max(priority,0) seconds, or the
// latency sensitivity when no priority is given.
func (h Hints) HeadStart() time.Duration {
	if h.HasPriority {
		return time.Duration(max(h.Priority, 0)) * time.Second
	}
	return time.Duration(h.LatencySensitivity * float64(time.Second))
}

// Subset is the data plane's endpoint subset hint. A nil *Subset means no
// hint; a non-nil one restricts candidates to its entries, and an empty one
// matches nothing.
type Subset struct {
	exact map[netip.AddrPort]struct{}
	anyIP map[netip.Addr]struct{}
	// Invalid counts entries that could not be parsed (they match nothing).
	Invalid int
}

// NewSubset parses subset entries: "ip:port" matches exactly, a bare IP
// (IPv6 bare or in brackets) matches every port of that IP. Spaces around
// entries are trimmed and empty entries skipped.
func NewSubset(entries []string) *Subset {
	s := &Subset{exact: map[netip.AddrPort]struct{}{}, anyIP: map[netip.Addr]struct{}{}}
	for _, e := range entries {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		if ap, err := ParseAddrPort(e); err == nil {
			s.exact[ap] = struct{}{}
			continue
		}
		host := strings.TrimSuffix(strings.TrimPrefix(e, "["), "]")
		if ip, err := netip.ParseAddr(host); err == nil && ip.Zone() == "" {
			s.anyIP[ip.Unmap()] = struct{}{}
			continue
		}
		s.Invalid++
	}
	return s
}

// Len is the number of valid entries.
func (s *Subset) Len() int { return len(s.exact) + len(s.anyIP) }

// Contains reports whether the subset admits ap.
func (s *Subset) Contains(ap netip.AddrPort) bool {
	if _, ok := s.exact[ap]; ok {
		return true
	}
	_, ok := s.anyIP[ap.Addr()]
	return ok
}

// Request is what the engine needs to route one request.
type Request struct {
	// ID is the request id (x-request-id) for logs; may be empty.
	ID string
	// Model is the requested model; empty for model-less requests such as
	// GET /v1/models, which any endpoint may serve.
	Model ModelName
	// Path is the HTTP path, for logs and per-path policy.
	Path string
	// Tenant scopes prefix state (from --tenant-header); may be empty.
	Tenant string
	// Tokens are the prompt's token ids; nil when the prompt was not
	// tokenized.
	Tokens []uint32
	// Keys are optional precomputed block keys of Tokens (for instance
	// from the tokenizer's prefix cache); the engine uses them instead of
	// hashing Tokens where they fit (see [BlockKeys]).
	Keys BlockKeys
	// TokenCount is the prompt length in tokens: len(Tokens) or an
	// estimate when Estimated is set.
	TokenCount int
	// Estimated marks TokenCount (and Tokens, if any) as a byte-based
	// estimate rather than the model tokenizer's output.
	Estimated bool
	// MaxTokens is the requested output limit; 0 when not given.
	MaxTokens int
	// Stream is set for SSE requests.
	Stream bool
	// CacheSalt isolates KV cache namespaces (vLLM cache_salt).
	CacheSalt string
	// LoRA names the adapter when the model is an adapter.
	LoRA string
	// Hints are the client's routing hints.
	Hints Hints
	// Subset restricts candidates; nil means no restriction.
	Subset *Subset
	// Arrival is when the request reached kvbandit.
	Arrival time.Time
}

// DefaultBlockSize is the KV block size in tokens (Dynamo's and vLLM's
// default) of endpoints whose block size is not known otherwise
// (--router-block-size).
const DefaultBlockSize = 16

// BlockKeys are the chained keys of a prompt's complete blocks for one block
// size and seed: kvindex.AppendBlockKeys(nil, Tokens, BlockSize, Seed). The
// engine uses them for the endpoints whose block size is BlockSize when Seed
// is the request's (kvindex.Seed(LoRA, CacheSalt)) and there is one key per
// complete block of Tokens, and hashes Tokens otherwise. It keeps Keys past
// Pick (the decision's in-flight blocks, the index insert) and never
// modifies them, so the caller must not modify them either.
type BlockKeys struct {
	BlockSize int
	Seed      uint64
	Keys      []uint64
}

// For returns the keys for blocks of bs tokens of tokens with seed, and
// whether k holds them.
func (k BlockKeys) For(bs int, seed uint64, tokens []uint32) ([]uint64, bool) {
	if bs <= 0 || k.BlockSize != bs || k.Seed != seed || len(k.Keys) != len(tokens)/bs {
		return nil, false
	}
	return k.Keys, true
}

// Errors returned by Pick; the ext_proc layer maps them to HTTP statuses.
var (
	// ErrNoEndpoints: no endpoint is known or eligible (503).
	ErrNoEndpoints = errors.New("no eligible endpoint")
	// ErrSubsetEmpty: the subset hint admits no known endpoint (503).
	ErrSubsetEmpty = errors.New("endpoint subset hint matches no eligible endpoint")
	// ErrModelNotFound: no endpoint serves the model (404).
	ErrModelNotFound = errors.New("model not found")
	// ErrOverloaded: the request was shed (429).
	ErrOverloaded = errors.New("overloaded")
)
