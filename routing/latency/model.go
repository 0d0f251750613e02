package latency

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
)

// Config parameterises the model.
type Config struct {
	// BatchTokens is the engine's prompt-token budget per step
	// (vLLM's max_num_batched_tokens; 8192).
	BatchTokens int `json:"batch_tokens"`
	// Forget is the pooled regression's weight kept per observation
	// (0.998: the last ~500 outcomes of the fleet dominate).
	Forget float64 `json:"forget"`
	// Ridge is the prior's weight, in observations, that pulls each
	// coefficient towards its prior value.
	Ridge float64 `json:"ridge"`
	// MemoryFull is the KV usage above which scraped waiting requests
	// count as blocked on memory.
	MemoryFull float64 `json:"memory_full"`
	// PriorSigma is the prior standard deviation of an endpoint's log
	// speed factor (0.15: within about ×0.86–×1.16 of the fleet until its
	// outcomes say otherwise).
	PriorSigma float64 `json:"prior_sigma"`
	// ObsSigma is the noise of one outcome's log TTFT ratio.
	ObsSigma float64 `json:"obs_sigma"`
	// SpeedForget discounts a factor's precision per observation (0.9).
	SpeedForget float64 `json:"speed_forget"`
	// MaxFactor bounds a factor (and one observation) to
	// [1/MaxFactor, MaxFactor].
	MaxFactor float64 `json:"max_factor"`
	// RemoteWeight is what one peer replica's outcome counts for in an
	// endpoint's factor, in local outcomes (1, the default: as much as a
	// local one; 0: peers teach the factors nothing). A peer's outcome
	// lacks the running sequences and scraped load at its decision, so its
	// ratio to the pooled fit is noisier; but replicas that learn their
	// factors apart disagree about the workers and split sessions between
	// them (docs/bench.md "Replicas" has both measured).
	RemoteWeight float64 `json:"remote_weight"`
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{BatchTokens: 8192, Forget: 0.998, Ridge: 2, MemoryFull: 0.9,
		PriorSigma: 0.15, ObsSigma: 0.35, SpeedForget: 0.9, MaxFactor: 8, RemoteWeight: 1}
}

// Validate checks the parameters, naming the bad field.
func (c Config) Validate() error {
	var errs []error
	check := func(name string, v, lo, hi float64, loOpen bool) {
		if math.IsNaN(v) || v < lo || v > hi || (loOpen && v == lo) {
			errs = append(errs, fmt.Errorf("latency.%s: %v out of range", name, v))
		}
	}
	check("batch_tokens", float64(c.BatchTokens), 1, 1<<24, false)
	check("forget", c.Forget, 0, 1, true)
	check("ridge", c.Ridge, 0, 1e6, true)
	check("memory_full", c.MemoryFull, 0, 1, false)
	check("prior_sigma", c.PriorSigma, 0, 10, false)
	check("obs_sigma", c.ObsSigma, 0, 10, true)
	check("speed_forget", c.SpeedForget, 0, 1, true)
	check("max_factor", c.MaxFactor, 1, math.Inf(1), false)
	check("remote_weight", c.RemoteWeight, 0, 1, false)
	return errors.Join(errs...)
}

// DetectWithin is the number of an endpoint's outcomes after which its
// mean log factor has covered at least frac of a step change in its speed
// (noise-free, from steady state): ⌈ln(1−frac)/ln SpeedForget⌉.
func (c Config) DetectWithin(frac float64) int {
	return int(math.Ceil(math.Log(1-frac) / math.Log(c.SpeedForget)))
}

// Features are what the model needs about one request on one candidate,
// known at decision time.
type Features struct {
	// Queued is the prompt tokens of in-flight requests on the candidate
	// not prefilled yet (ahead of this one).
	Queued int64
	// Uncached is this request's prompt tokens not cached there.
	Uncached int
	// Running is the sequences running there.
	Running float64
	// Waiting and KVUsage are the scraped load.
	Waiting float64
	KVUsage float64
}

// FromCandidate returns the features of a request of isl tokens on c. Its
// cached blocks are c's effective overlap under w: a block in host memory or
// on disk counts as a share of a GPU hit (routing.TierWeights).
func FromCandidate(c *routing.Candidate, isl, blockSize int, w routing.TierWeights) Features {
	running := float64(c.InFlight())
	if c.Load.Known && !c.Load.Stale {
		running = c.Load.Running
	}
	return Features{
		Queued:   c.ActivePrefillTokens,
		Uncached: max(isl-int(c.EffectiveOverlap(w)*float64(max(blockSize, 1))), 0),
		Running:  running,
		Waiting:  c.Load.Waiting,
		KVUsage:  c.Load.KVUsage,
	}
}

// nT is the number of TTFT regressors: W/B, steps, 1, decode step, waiting.
const nT = 5

// Coefficients are the pooled fit, in milliseconds.
type Coefficients struct {
	// PerBatch is the time per BatchTokens prompt tokens (a), PerStep the
	// overhead per step (b), Base the constant (c), DecodeShare the share of
	// a decode step in progress that a request waits (h), PerWaiting the
	// wait per request blocked on memory (m).
	PerBatch, PerStep, Base, DecodeShare, PerWaiting float64
	// DecodeBase and DecodePerRunning give a decode step's time.
	DecodeBase, DecodePerRunning float64
	// Observations is the number of outcomes folded in.
	Observations int
}

// prior is where the fit starts: a plausible GPU (150 ms per 8k tokens,
// 15 ms per step, half a decode step of 8 ms). It matters only until the
// first outcomes.
var prior = Coefficients{PerBatch: 150, PerStep: 15, Base: 5, DecodeShare: 0.5, PerWaiting: 0, DecodeBase: 8, DecodePerRunning: 0.1}

func (k *Coefficients) ttft() [nT]float64 {
	return [nT]float64{k.PerBatch, k.PerStep, k.Base, k.DecodeShare, k.PerWaiting}
}

// decode is the predicted decode step time (ms) with running sequences.
func (k *Coefficients) decode(running float64) float64 {
	return max(k.DecodeBase+k.DecodePerRunning*running, 0)
}

// Model is the latency model. It is safe for concurrent use.
type Model struct {
	cfg  Config
	coef atomic.Pointer[Coefficients]

	mu  sync.Mutex // writers of the fits
	tt  wls        // TTFT fit
	dec wls        // decode step fit

	speeds sync.Map // key → *belief
	fleet  fleetMean
	// sources interns the peers whose outcomes the factors learnt
	// (Observation.Peer), at most evidence.MaxPeers at a time.
	sources *evidence.Sources
}

type key struct {
	ep   routing.EndpointKey
	rank int
}

// New returns a model at its prior.
func New(cfg Config) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Model{cfg: cfg, sources: evidence.NewSources(evidence.MaxPeers)}
	p := prior
	m.coef.Store(&p)
	pt := p.ttft()
	// The ridge is scaled per regressor so that it weighs like cfg.Ridge
	// observations of a typical magnitude (one batch, one step, a 20 ms
	// decode step, 4 waiting requests).
	m.tt = newWLS(pt[:], []float64{1, 1, 1, 400, 16}, cfg.Ridge, cfg.Forget)
	m.dec = newWLS([]float64{p.DecodeBase, p.DecodePerRunning}, []float64{1, 2500}, cfg.Ridge, cfg.Forget)
	return m, nil
}

// Config returns the model's parameters.
func (m *Model) Config() Config { return m.cfg }

// Coefficients returns the current pooled fit.
func (m *Model) Coefficients() Coefficients { return *m.coef.Load() }

// Estimate is a prediction before the speed factor: Total is the TTFT
// and Own the request's own prefill, in milliseconds at the fleet's pooled
// speed; Decode is the predicted decode step on the candidate.
type Estimate struct {
	Total, Own, Decode float64
	Running            float64
}

func (m *Model) regressors(k *Coefficients, f Features) (x [nT]float64, own float64) {
	b := float64(m.cfg.BatchTokens)
	w := float64(max(f.Queued, 0)) + float64(max(f.Uncached, 0))
	steps := math.Ceil(w / b)
	x[0], x[1], x[2] = w/b, steps, 1
	if f.Running > 0 {
		x[3] = k.decode(f.Running)
	}
	if f.KVUsage >= m.cfg.MemoryFull {
		x[4] = f.Waiting
	}
	own = max(k.PerBatch, 0)*float64(max(f.Uncached, 0))/b + max(k.PerStep, 0)*(steps-math.Ceil(float64(max(f.Queued, 0))/b))
	return x, own
}

// Estimate returns the prediction for f at the pooled speed.
func (m *Model) Estimate(f Features) Estimate {
	k := m.coef.Load()
	x, own := m.regressors(k, f)
	th := k.ttft()
	var total float64
	for i := range x {
		total += th[i] * x[i]
	}
	total = max(total, own, 0)
	return Estimate{Total: total, Own: own, Decode: x[3], Running: max(f.Running, 0)}
}

// Prediction scales e by the speed factor into a [routing.Prediction].
func (e Estimate) Prediction(factor float64) routing.Prediction {
	ttft := factor * e.Total
	own := factor * e.Own
	return routing.Prediction{TTFT: ms(ttft), Wait: ms(ttft - own), Prefill: ms(own), Impact: ms(e.Running * own)}
}

func ms(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// Predict returns the posterior-mean prediction for f on c.
func (m *Model) Predict(c *routing.Candidate, f Features) routing.Prediction {
	mean, _ := m.Factor(c)
	return m.Estimate(f).Prediction(math.Exp(mean))
}

// Observation is one finished request.
type Observation struct {
	Endpoint routing.EndpointKey
	DPRank   int
	Features Features
	// TTFT and Latency are the measured times; Output the tokens generated
	// (Latency and Output may be 0 when unknown).
	TTFT, Latency time.Duration
	Output        int
	// Remote marks a peer's outcome: Running and the scraped load are not
	// known, so it teaches the endpoint's factor only. Peer is the peer
	// replica's id (routing.RemoteOutcome.Peer): what it teaches is kept
	// apart from the rest, for ForgetPeer.
	Remote bool
	Peer   string
	At     time.Time
}

// Observe folds one outcome into the endpoint's factor and the pooled fits.
func (m *Model) Observe(o Observation) {
	if o.TTFT <= 0 {
		return
	}
	y := o.TTFT.Seconds() * 1000
	k0 := key{o.Endpoint, o.DPRank}
	if o.Remote {
		// A peer does not share the running sequences at its decision:
		// take the endpoint's recent mean from this replica's own outcomes
		// (0 before any), so that its outcome is not read as slowness.
		o.Features.Running = m.recentRunning(k0)
	}
	m.mu.Lock()
	k := m.coef.Load()
	x, _ := m.regressors(k, o.Features)
	th := k.ttft()
	var pred float64
	for i := range x {
		pred += th[i] * x[i]
	}
	if pred <= 0 {
		pred = 1e-3
	}
	if !o.Remote {
		next := *k
		next.Observations++
		m.tt.add(x[:], y)
		t := m.tt.solve()
		next.PerBatch, next.PerStep, next.Base, next.DecodeShare, next.PerWaiting = t[0], t[1], t[2], t[3], t[4]
		if o.Output > 1 && o.Latency > o.TTFT {
			step := (o.Latency - o.TTFT).Seconds() * 1000 / float64(o.Output-1)
			m.dec.add([]float64{1, o.Features.Running}, step)
			d := m.dec.solve()
			next.DecodeBase, next.DecodePerRunning = d[0], d[1]
		}
		m.coef.Store(&next)
	}
	m.mu.Unlock()
	lim := math.Log(m.cfg.MaxFactor)
	rel := min(max(math.Log(y/pred), -lim), lim)
	if !o.Remote {
		m.observeSpeed(k0, rel, o.At, o.Features.Running, evidence.Local)
		return
	}
	if m.cfg.RemoteWeight == 0 {
		return // peers teach nothing: do not intern them
	}
	m.sources.Use(o.Peer, m.forgetSource, func(src evidence.Source) {
		m.observeSpeed(k0, rel, o.At, o.Features.Running, src)
	})
}

// wls is an exponentially weighted least-squares fit with a ridge towards
// a prior: θ = (S + R)⁻¹ (s + R·θ₀), S = Σ λ^age x xᵀ, s = Σ λ^age x y.
// The ridge is not discounted, so a regressor that stays 0 keeps its
// prior instead of winding up.
type wls struct {
	n      int
	forget float64
	s      []float64 // n×n
	xy     []float64
	r      []float64 // ridge diagonal
	theta0 []float64
	a      []float64 // scratch n×(n+1)
}

func newWLS(theta0, scale []float64, ridge, forget float64) wls {
	n := len(theta0)
	w := wls{n: n, forget: forget, s: make([]float64, n*n), xy: make([]float64, n), r: make([]float64, n),
		theta0: slices.Clone(theta0), a: make([]float64, n*(n+1))}
	for i := range n {
		w.r[i] = ridge * scale[i]
	}
	return w
}

func (w *wls) add(x []float64, y float64) {
	for i := range w.n {
		w.xy[i] = w.forget*w.xy[i] + x[i]*y
		for j := range w.n {
			w.s[i*w.n+j] = w.forget*w.s[i*w.n+j] + x[i]*x[j]
		}
	}
}

// solve returns θ by Gaussian elimination with partial pivoting (the
// system is symmetric positive definite thanks to the ridge).
func (w *wls) solve() []float64 {
	n, a := w.n, w.a
	for i := range n {
		for j := range n {
			a[i*(n+1)+j] = w.s[i*n+j]
		}
		a[i*(n+1)+i] += w.r[i]
		a[i*(n+1)+n] = w.xy[i] + w.r[i]*w.theta0[i]
	}
	for col := range n {
		p := col
		for r := col + 1; r < n; r++ {
			if math.Abs(a[r*(n+1)+col]) > math.Abs(a[p*(n+1)+col]) {
				p = r
			}
		}
		if p != col {
			for j := range n + 1 {
				a[col*(n+1)+j], a[p*(n+1)+j] = a[p*(n+1)+j], a[col*(n+1)+j]
			}
		}
		piv := a[col*(n+1)+col]
		if piv == 0 {
			return slices.Clone(w.theta0)
		}
		for r := col + 1; r < n; r++ {
			f := a[r*(n+1)+col] / piv
			for j := col; j <= n; j++ {
				a[r*(n+1)+j] -= f * a[col*(n+1)+j]
			}
		}
	}
	out := make([]float64, n)
	for i := n - 1; i >= 0; i-- {
		v := a[i*(n+1)+n]
		for j := i + 1; j < n; j++ {
			v -= a[i*(n+1)+j] * out[j]
		}
		out[i] = v / a[i*(n+1)+i]
		if math.IsNaN(out[i]) || math.IsInf(out[i], 0) {
			return slices.Clone(w.theta0)
		}
	}
	return out
}
