package trace

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// AgenticConfig shapes a synthetic agent workload: sessions arrive as a
// Poisson process; each is a chain of turns whose prompt resends the whole
// history (system prompt, then every earlier user message and answer) plus
// a new user message.
type AgenticConfig struct {
	// Sessions is the number of sessions (default 800).
	Sessions int
	// SessionRate is the mean session arrival rate per second (default 8).
	SessionRate float64
	// Turns is the number of requests per session (default 8).
	Turns int
	// ThinkTime separates the arrivals of two turns of a session
	// (default 10s). The simulator does not feed completions back into the
	// generator, so the think time is counted from the previous turn's
	// arrival and should exceed its expected latency.
	ThinkTime time.Duration
	// SystemPromptLen is the length of the shared system prompt in tokens
	// (default 2048; negative: none).
	SystemPromptLen int
	// SystemPrompts is the number of distinct system prompts; sessions
	// pick one at random (default 4).
	SystemPrompts int
	// Tenants spreads sessions round-robin over this many tenants
	// (default 1: no tenant).
	Tenants int
	// InputLen is the mean length of a turn's new user tokens (default
	// 1024); OutputLen the mean answer length (default 256). Each turn
	// draws uniformly in [mean/2, 3·mean/2].
	InputLen, OutputLen int
	// NoTotals leaves TotalRequests out of the hints: each session sends
	// only its id (x-prefix-id without x-prefix-total-requests).
	NoTotals bool
	// Seed makes the workload repeatable.
	Seed int64
	// Model is copied into every request.
	Model string
}

// Defaults returns c with zero fields set to their defaults.
func (c AgenticConfig) Defaults() AgenticConfig {
	if c.Sessions == 0 {
		c.Sessions = 800
	}
	if c.SessionRate == 0 {
		c.SessionRate = 8
	}
	if c.Turns == 0 {
		c.Turns = 8
	}
	if c.ThinkTime == 0 {
		c.ThinkTime = 10 * time.Second
	}
	switch {
	case c.SystemPromptLen == 0:
		c.SystemPromptLen = 2048
	case c.SystemPromptLen < 0:
		c.SystemPromptLen = 0
	}
	if c.SystemPrompts == 0 {
		c.SystemPrompts = 4
	}
	if c.Tenants == 0 {
		c.Tenants = 1
	}
	if c.InputLen == 0 {
		c.InputLen = 1024
	}
	if c.OutputLen == 0 {
		c.OutputLen = 256
	}
	return c
}

// Validate checks a defaulted config.
func (c AgenticConfig) Validate() error {
	var errs []error
	if c.Sessions < 0 {
		errs = append(errs, fmt.Errorf("sessions %d: must be > 0", c.Sessions))
	}
	if !(c.SessionRate > 0) {
		errs = append(errs, fmt.Errorf("session rate %v: must be > 0", c.SessionRate))
	}
	if c.Turns < 0 {
		errs = append(errs, fmt.Errorf("turns %d: must be > 0", c.Turns))
	}
	if c.ThinkTime < 0 {
		errs = append(errs, fmt.Errorf("think time %v: must be >= 0", c.ThinkTime))
	}
	if c.Tenants < 0 {
		errs = append(errs, fmt.Errorf("tenants %d: must be > 0", c.Tenants))
	}
	if c.InputLen < 0 || c.InputLen > MaxTokens || c.OutputLen < 0 || c.OutputLen > MaxTokens {
		errs = append(errs, fmt.Errorf("input/output length %d/%d: must be in [1, %d]", c.InputLen, c.OutputLen, MaxTokens))
	}
	if c.Turns > 0 && c.SystemPromptLen+c.Turns*(3*c.InputLen/2+3*c.OutputLen/2+1) > MaxTokens {
		errs = append(errs, fmt.Errorf("the last turn's prompt could exceed %d tokens", MaxTokens))
	}
	return errors.Join(errs...)
}

// Agentic generates the workload: one request per turn, sorted by
// arrival. Requests of a session carry Hints{PrefixID: "s<i>",
// TotalRequests: turns (0 with NoTotals), OSL/OSLTokens: the answer
// length, IAT/IATMillis: the think time}. The same config gives the same requests.
func Agentic(cfg AgenticConfig) ([]sim.Request, error) {
	cfg = cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(uint64(cfg.Seed), 0x6167656e74696321))
	draw := func(mean int) int {
		if mean <= 1 {
			return max(mean, 1)
		}
		return mean/2 + rng.IntN(mean+1)
	}
	iatMillis := int(cfg.ThinkTime / time.Millisecond)
	total := cfg.Turns
	if cfg.NoTotals {
		total = 0
	}
	reqs := make([]sim.Request, 0, cfg.Sessions*cfg.Turns)
	var start time.Duration
	for s := range cfg.Sessions {
		start += time.Duration(rng.ExpFloat64() / cfg.SessionRate * float64(time.Second))
		sys := 0
		if cfg.SystemPrompts > 1 {
			sys = rng.IntN(cfg.SystemPrompts)
		}
		tenant := ""
		if cfg.Tenants > 1 {
			tenant = "t" + strconv.Itoa(s%cfg.Tenants)
		}
		history := appendTokens(nil, saltSystem, uint64(sys), 0, cfg.SystemPromptLen)
		for t := range cfg.Turns {
			stream := uint64(s)<<20 | uint64(t)<<1
			history = appendTokens(history, saltTurn, stream, 0, draw(cfg.InputLen))
			out := draw(cfg.OutputLen)
			reqs = append(reqs, sim.Request{
				Arrival:   start + time.Duration(t)*cfg.ThinkTime,
				Tokens:    history[:len(history):len(history)],
				OutputLen: out,
				Model:     cfg.Model,
				Tenant:    tenant,
				Hints: routing.Hints{
					PrefixID:      "s" + strconv.Itoa(s),
					TotalRequests: total,
					OSL:           oslLevel(out),
					OSLTokens:     out,
					IAT:           iatLevel(iatMillis),
					IATMillis:     iatMillis,
				},
			})
			// The answer becomes part of the next turn's history.
			history = appendTokens(history, saltTurn, stream|1, 0, out)
		}
	}
	finish(reqs, Options{})
	return reqs, nil
}

// oslLevel and iatLevel use the thresholds of the x-prefix-* header
// parser (extproc/hints).
func oslLevel(tokens int) routing.Level {
	switch {
	case tokens < 256:
		return routing.LevelLow
	case tokens < 1024:
		return routing.LevelMedium
	}
	return routing.LevelHigh
}

func iatLevel(ms int) routing.Level {
	switch {
	case ms < 100:
		return routing.LevelLow
	case ms < 500:
		return routing.LevelMedium
	}
	return routing.LevelHigh
}
