// Package pd decides prefill/decode disaggregation (llm-d's P/D, Dynamo's
// conditional disaggregation) after the policy has chosen a request's
// decode endpoint: it implements [routing.Disaggregator].
//
// A request is disaggregated when its pool has prefill-role endpoints, it
// has prompt tokens, the tokens left to prefill on the chosen decode
// endpoint (prompt tokens minus its cached prefix) reach the threshold,
// and a prefill or both endpoint other than the decode endpoint is
// eligible. The prefill endpoint is then chosen by the policy's prefill
// cost ([routing.PrefillChooser]: KV overlap and prefill load for kv and
// kvbandit, an own rotation for round_robin) or, for policies without one,
// by the policy's Choose without commit (least_loaded, random: each role
// picked independently).
package pd

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// DefaultThresholdTokens is the default of Config.ThresholdTokens. The
// rule is that of llm-d's prefix-based-pd-decider (its nonCachedTokens),
// whose default, 0, disaggregates every prompt; kvbandit keeps short
// prompts local instead: 512 tokens (32 blocks of 16) is one prefill step
// of an 8B model, an estimate of a few tens of milliseconds on a
// datacenter GPU, about what a P/D round adds (the sidecar's extra request
// to the prefill worker, then the KV transfer), so below it
// disaggregation cannot pay for itself. Measure it on your fleet.
const DefaultThresholdTokens = 512

// MaxThresholdTokens bounds the threshold (a larger value turns P/D off in
// practice; 0 disaggregates every request with a body).
const MaxThresholdTokens = 1 << 24

// Config is the YAML section "pd".
type Config struct {
	// ThresholdTokens: a request whose uncached prompt tokens on the chosen
	// decode endpoint are fewer stays aggregated (--pd-threshold-tokens).
	ThresholdTokens int `json:"threshold_tokens"`
	// StripKVTransferParams removes a client's kv_transfer_params from
	// request bodies in every pool (--pd-strip-kv-transfer-params). In a
	// pool with prefill endpoints it is removed whatever this says: only
	// the picker's P/D protocol may name a host for the decode engine's
	// KV connector.
	StripKVTransferParams bool `json:"strip_kv_transfer_params"`
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config { return Config{ThresholdTokens: DefaultThresholdTokens} }

// ErrConfig is wrapped by Validate's errors.
var ErrConfig = errors.New("invalid pd config")

// Validate checks the parameters, naming the bad field.
func (c Config) Validate() error {
	if c.ThresholdTokens < 0 || c.ThresholdTokens > MaxThresholdTokens {
		return fmt.Errorf("%w: pd.threshold_tokens: %d out of 0..%d", ErrConfig, c.ThresholdTokens, MaxThresholdTokens)
	}
	return nil
}

// Decider is the engine's disaggregation stage (routing/engine calls
// Split after the policy has chosen the decode endpoint).
type Decider struct {
	cfg Config
}

// New returns a decider; cfg must be valid.
func New(cfg Config) (*Decider, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Decider{cfg: cfg}, nil
}

// Split decides, after the policy has chosen the decode candidate dec,
// whether the request prefills elsewhere: the index in pre.Candidates of
// the prefill endpoint with PDDisaggregated, or -1 and why it stays
// aggregated. With commit false it has no side effects.
func (d *Decider) Split(pre *routing.Scoring, dec *routing.Candidate, p routing.Policy, commit bool) (int, any, routing.PDOutcome) {
	if pre.ISL <= 0 {
		return -1, nil, routing.PDNoBody
	}
	if Remaining(pre.ISL, pre.BlockSize, dec) < d.cfg.ThresholdTokens {
		return -1, nil, routing.PDBelowThreshold
	}
	// The decode endpoint itself (a both endpoint) is no prefill choice:
	// prefilling there is the aggregated case.
	s, idx := pre, []int(nil)
	if slices.ContainsFunc(pre.Candidates, func(c routing.Candidate) bool { return c.Key() == dec.Key() }) {
		cp := *pre
		cp.Candidates = make([]routing.Candidate, 0, len(pre.Candidates)-1)
		for i := range pre.Candidates {
			if c := &pre.Candidates[i]; c.Key() != dec.Key() {
				cp.Candidates = append(cp.Candidates, *c)
				idx = append(idx, i)
			}
		}
		s = &cp
	}
	if len(s.Candidates) == 0 {
		return -1, nil, routing.PDNoEligiblePrefill
	}
	var ch routing.Choice
	var err error
	if pc, ok := p.(routing.PrefillChooser); ok {
		ch, err = pc.ChoosePrefill(s, commit)
	} else {
		ch, err = p.Choose(s, false)
	}
	if err != nil || ch.Index < 0 || ch.Index >= len(s.Candidates) {
		return -1, nil, routing.PDNoEligiblePrefill
	}
	if idx != nil {
		return idx[ch.Index], ch.State, routing.PDDisaggregated
	}
	return ch.Index, ch.State, routing.PDDisaggregated
}

// Remaining is the prompt tokens left to prefill on c: isl minus its cached
// prefix (in blocks of blockSize), at least 0.
func Remaining(isl, blockSize int, c *routing.Candidate) int {
	return max(isl-c.Overlap*max(blockSize, 1), 0)
}
