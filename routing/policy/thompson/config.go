package thompson

import (
	"errors"
	"fmt"
	"math"
)

// Config holds the policy's parameters under the reference router's config
// paths (external/dynamo/components/config.yaml of NeMo Agent Toolkit).
// Start from [DefaultConfig] and decode the file on top of it: many valid
// values are zero, so a zero field never means "default".
type Config struct {
	Affinity      AffinityConfig      `json:"affinity"`
	SwitchingCost SwitchingCostConfig `json:"switching_cost"`
	LoadBalancing LoadBalancingConfig `json:"load_balancing"`
	Prefill       PrefillConfig       `json:"prefill"`
	LinTS         LinTSConfig         `json:"lints"`
	Exploration   ExplorationConfig   `json:"exploration"`
	Feedback      FeedbackConfig      `json:"feedback"`

	// IdleEndpointSeconds drops the learned state (Beta, LinTS, latency
	// baselines) of an endpoint that has not been a candidate for this long,
	// so endpoints that left the fleet do not accumulate. 0 keeps state
	// forever (the reference's behaviour). Must be at least
	// feedback.timeout_seconds so that no pending decision outlives its
	// endpoint's state. Not in the reference.
	IdleEndpointSeconds float64 `json:"idle_endpoint_seconds"`

	// ReferenceCompat turns on every field of Compat: the reference
	// router's behaviour, defects included.
	ReferenceCompat bool `json:"reference_compat"`
	// Compat selects the reference's behaviour one defect at a time.
	Compat CompatConfig `json:"compat"`
}

// CompatConfig brings back reference behaviours that kvbandit fixes by
// default.
type CompatConfig struct {
	// ScaledSwitchingCost subtracts the switching cost before the load
	// modifier multiplies the score (reference §3.6 step 6). Under load a
	// negative score then moves toward zero, so a busier endpoint is
	// penalised less for breaking affinity. Fixed: the cost is subtracted
	// after the load modifier.
	ScaledSwitchingCost bool `json:"scaled_switching_cost"`
	// NoPrefixExpiry builds the policy's private prefix store without a TTL
	// (entries go only when their budget is spent or the LRU bound evicts
	// them). It has no effect on a store passed in Deps.Prefix.
	NoPrefixExpiry bool `json:"no_prefix_expiry"`
	// LateJoinersBlind treats endpoints first seen after the policy's first
	// decision as the reference does: no KV overlap (no event listener) and
	// no scraped load (the pending fallback), because it assigns metrics and
	// KV-event ports by rank in the startup worker list only.
	LateJoinersBlind bool `json:"late_joiners_blind"`
	// RebuiltFeatures stores, for learning, the chosen endpoint's feature
	// vector with the outstanding-work feature recomputed after the prefix
	// was pinned, as the reference does; fixed: the vector used for scoring
	// is stored.
	RebuiltFeatures bool `json:"rebuilt_features"`
	// SessionNeedsTotal counts a request that announces no total as a
	// group of one, as the reference does: a prefix id alone then earns no
	// affinity. Fixed: such a session is assumed to continue (see
	// prefixstate.Store.Arrive).
	SessionNeedsTotal bool `json:"session_needs_total"`
}

// AffinityConfig is the bonus for staying on the prefix's last endpoint.
type AffinityConfig struct {
	Base            float64 `json:"base"`
	ReuseWeight     float64 `json:"reuse_weight"`
	IATWeight       float64 `json:"iat_weight"`
	StickyLoadFloor float64 `json:"sticky_load_floor"`
}

// SwitchingCostConfig is the penalty for leaving the prefix's last endpoint.
type SwitchingCostConfig struct {
	Base         float64 `json:"base"`
	ReusePenalty float64 `json:"reuse_penalty"`
	IATPenalty   float64 `json:"iat_penalty"`
}

// LoadBalancingConfig weighs load in the load modifier and feature 1.
type LoadBalancingConfig struct {
	QueuePenaltyWeight     float64 `json:"queue_penalty_weight"`
	GPUPenaltyWeight       float64 `json:"gpu_penalty_weight"`
	OutstandingWorkWeight  float64 `json:"outstanding_work_weight"`
	JobGPUCouplingWeight   float64 `json:"job_gpu_coupling_weight"`
	JobQueueCouplingWeight float64 `json:"job_queue_coupling_weight"`
}

// PrefillConfig scales the uncached prompt into a prefill cost.
type PrefillConfig struct {
	TokenScale float64 `json:"token_scale"`
	Weight     float64 `json:"weight"`
}

// LinTSConfig configures the per-(endpoint, rank) linear Thompson sampler.
type LinTSConfig struct {
	// Lambda is the ridge prior: A starts at λI.
	Lambda float64 `json:"lambda"`
	// V multiplies the posterior standard deviation (covariance v²A⁻¹).
	V float64 `json:"v"`
	// ForgetRate γ discounts old observations; memory ≈ 1/(1−γ).
	ForgetRate float64 `json:"forget_rate"`
}

// ExplorationConfig sets the Beta weight and the softmax temperature.
type ExplorationConfig struct {
	BaseTSWeight float64           `json:"base_ts_weight"`
	Temperature  TemperatureConfig `json:"temperature"`
}

// TemperatureConfig is the softmax temperature T = clamp(base/(1+R·iat),
// min, max).
type TemperatureConfig struct {
	Base float64 `json:"base"`
	Min  float64 `json:"min"`
	Max  float64 `json:"max"`
}

// FeedbackConfig configures rewards and the feedback timeout.
type FeedbackConfig struct {
	// TimeoutSeconds after a decision without an outcome, both bandits
	// learn TimeoutReward.
	TimeoutSeconds float64 `json:"timeout_seconds"`
	// SweepIntervalSeconds is accepted for compatibility and unused:
	// kvbandit arms one timer per decision on the injected clock, so a
	// decision expires exactly TimeoutSeconds after it was made instead of
	// within one sweep interval on the next request.
	SweepIntervalSeconds float64 `json:"sweep_interval_seconds"`
	TimeoutReward        float64 `json:"timeout_reward"`
	// LatencyEMAAlpha is the weight of a new latency in the baselines.
	LatencyEMAAlpha float64 `json:"latency_ema_alpha"`
}

// DefaultConfig returns the values of the reference's shipped config.yaml
// (research notes §3.8, "shipped config.yaml" column), with the defects
// fixed and endpoint state dropped after 30 idle minutes.
func DefaultConfig() Config {
	return Config{
		Affinity:      AffinityConfig{Base: 0.30, ReuseWeight: 0.08, IATWeight: 0.20, StickyLoadFloor: 0.01},
		SwitchingCost: SwitchingCostConfig{Base: 0.10, ReusePenalty: 0.04, IATPenalty: 0.03},
		LoadBalancing: LoadBalancingConfig{
			QueuePenaltyWeight:     1.50,
			GPUPenaltyWeight:       1.00,
			OutstandingWorkWeight:  0.45,
			JobGPUCouplingWeight:   0.40,
			JobQueueCouplingWeight: 0.20,
		},
		Prefill:             PrefillConfig{TokenScale: 1024, Weight: 1},
		LinTS:               LinTSConfig{Lambda: 1, V: 0.25, ForgetRate: 0.995},
		Exploration:         ExplorationConfig{BaseTSWeight: 0.10, Temperature: TemperatureConfig{Base: 1, Min: 0.15, Max: 2}},
		Feedback:            FeedbackConfig{TimeoutSeconds: 120, SweepIntervalSeconds: 5, TimeoutReward: 0, LatencyEMAAlpha: 0.2},
		IdleEndpointSeconds: 1800,
	}
}

// ErrInvalidConfig is wrapped by every [Config.Validate] error.
var ErrInvalidConfig = errors.New("invalid thompson config")

// Validate checks every field and names the first bad one, for example
// "thompson.lints.forget_rate: must be in (0, 1]".
func (c *Config) Validate() error {
	type check struct {
		name string
		v    float64
		ok   func(float64) bool
		want string
	}
	nonneg := func(v float64) bool { return v >= 0 && !math.IsInf(v, 1) }
	pos := func(v float64) bool { return v > 0 && !math.IsInf(v, 1) }
	unit := func(v float64) bool { return v >= 0 && v <= 1 }
	halfOpen := func(v float64) bool { return v > 0 && v <= 1 }
	checks := []check{
		{"affinity.base", c.Affinity.Base, nonneg, "must be a finite number >= 0"},
		{"affinity.reuse_weight", c.Affinity.ReuseWeight, nonneg, "must be a finite number >= 0"},
		{"affinity.iat_weight", c.Affinity.IATWeight, nonneg, "must be a finite number >= 0"},
		{"affinity.sticky_load_floor", c.Affinity.StickyLoadFloor, unit, "must be in [0, 1]"},
		{"switching_cost.base", c.SwitchingCost.Base, nonneg, "must be a finite number >= 0"},
		{"switching_cost.reuse_penalty", c.SwitchingCost.ReusePenalty, nonneg, "must be a finite number >= 0"},
		{"switching_cost.iat_penalty", c.SwitchingCost.IATPenalty, nonneg, "must be a finite number >= 0"},
		{"load_balancing.queue_penalty_weight", c.LoadBalancing.QueuePenaltyWeight, nonneg, "must be a finite number >= 0"},
		{"load_balancing.gpu_penalty_weight", c.LoadBalancing.GPUPenaltyWeight, nonneg, "must be a finite number >= 0"},
		{"load_balancing.outstanding_work_weight", c.LoadBalancing.OutstandingWorkWeight, nonneg, "must be a finite number >= 0"},
		{"load_balancing.job_gpu_coupling_weight", c.LoadBalancing.JobGPUCouplingWeight, nonneg, "must be a finite number >= 0"},
		{"load_balancing.job_queue_coupling_weight", c.LoadBalancing.JobQueueCouplingWeight, nonneg, "must be a finite number >= 0"},
		{"prefill.token_scale", c.Prefill.TokenScale, pos, "must be a finite number > 0"},
		{"prefill.weight", c.Prefill.Weight, nonneg, "must be a finite number >= 0"},
		{"lints.lambda", c.LinTS.Lambda, pos, "must be a finite number > 0"},
		{"lints.v", c.LinTS.V, nonneg, "must be a finite number >= 0"},
		{"lints.forget_rate", c.LinTS.ForgetRate, halfOpen, "must be in (0, 1]"},
		{"exploration.base_ts_weight", c.Exploration.BaseTSWeight, nonneg, "must be a finite number >= 0"},
		{"exploration.temperature.base", c.Exploration.Temperature.Base, pos, "must be a finite number > 0"},
		{"exploration.temperature.min", c.Exploration.Temperature.Min, pos, "must be a finite number > 0"},
		{"exploration.temperature.max", c.Exploration.Temperature.Max, pos, "must be a finite number > 0"},
		{"feedback.timeout_seconds", c.Feedback.TimeoutSeconds, pos, "must be a finite number > 0"},
		{"feedback.sweep_interval_seconds", c.Feedback.SweepIntervalSeconds, nonneg, "must be a finite number >= 0"},
		{"feedback.timeout_reward", c.Feedback.TimeoutReward, unit, "must be in [0, 1]"},
		{"feedback.latency_ema_alpha", c.Feedback.LatencyEMAAlpha, halfOpen, "must be in (0, 1]"},
		{"idle_endpoint_seconds", c.IdleEndpointSeconds, nonneg, "must be a finite number >= 0"},
	}
	for _, ch := range checks {
		// NaN fails every comparison, so every ok func refuses it.
		if !ch.ok(ch.v) {
			return fmt.Errorf("%w: thompson.%s: %s (got %v)", ErrInvalidConfig, ch.name, ch.want, ch.v)
		}
	}
	if t := c.Exploration.Temperature; t.Min > t.Max {
		return fmt.Errorf("%w: thompson.exploration.temperature: min (%v) must not exceed max (%v)", ErrInvalidConfig, t.Min, t.Max)
	}
	if c.IdleEndpointSeconds > 0 && c.IdleEndpointSeconds < c.Feedback.TimeoutSeconds {
		return fmt.Errorf("%w: thompson.idle_endpoint_seconds: must be 0 or at least feedback.timeout_seconds (%v), got %v",
			ErrInvalidConfig, c.Feedback.TimeoutSeconds, c.IdleEndpointSeconds)
	}
	return nil
}

// compat returns the effective compatibility switches.
func (c *Config) compat() CompatConfig {
	if c.ReferenceCompat {
		return CompatConfig{ScaledSwitchingCost: true, NoPrefixExpiry: true, LateJoinersBlind: true, RebuiltFeatures: true, SessionNeedsTotal: true}
	}
	return c.Compat
}
