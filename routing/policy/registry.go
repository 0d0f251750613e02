// Package policy registers the routing policies selectable with --policy.
// Every policy lives in its own sub-package; this file is the one place
// that lists them.
package policy

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/policy/kv"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/policy/leastloaded"
	"github.com/kvbandit/kvbandit/routing/policy/random"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/policy/weighted"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// Deps are what a policy may depend on.
type Deps struct {
	Logger *slog.Logger
	Clock  clock.Clock
	Rand   *routing.Rand
	// Config holds every policy's parameters (zero value: DefaultConfig).
	Config *Config
	// Prefixes is the prefix state shared by the hint-aware policies; nil
	// gives each such policy a private store.
	Prefixes *prefixstate.Store
	// OnReward, if set, observes every reward a learning policy applies.
	OnReward func(float64)
}

// Config holds the parameters of every policy, under the YAML keys of the
// config file.
type Config struct {
	KV       kv.Config       `json:"kv"`
	KVBandit kvbandit.Config `json:"kvbandit"`
	Thompson thompson.Config `json:"thompson"`
	Weighted weighted.Config `json:"weighted"`
}

// DefaultConfig returns every policy's defaults.
func DefaultConfig() Config {
	return Config{KV: kv.DefaultConfig(), KVBandit: kvbandit.DefaultConfig(), Thompson: thompson.DefaultConfig(), Weighted: weighted.DefaultConfig()}
}

// Validate checks every policy's parameters (so that a bad value is refused
// at start-up even for a policy not selected now).
func (c *Config) Validate() error {
	return errors.Join(c.KV.Validate(), c.KVBandit.Validate(), c.Thompson.Validate(), c.Weighted.Validate())
}

// Factory builds a policy.
type Factory func(Deps) (routing.Policy, error)

// Registry maps policy names to factories.
type Registry struct {
	factories map[string]Factory
}

// ErrUnknownPolicy is returned for a name that is not registered.
var ErrUnknownPolicy = errors.New("unknown policy")

// Register adds a factory; a duplicate name is an error.
func (r *Registry) Register(name string, f Factory) error {
	if r.factories == nil {
		r.factories = map[string]Factory{}
	}
	if _, dup := r.factories[name]; dup {
		return fmt.Errorf("policy %q registered twice", name)
	}
	r.factories[name] = f
	return nil
}

// New builds the named policy.
func (r *Registry) New(name string, deps Deps) (routing.Policy, error) {
	f, ok := r.factories[name]
	if !ok {
		return nil, fmt.Errorf("%w %q (known: %s)", ErrUnknownPolicy, name, strings.Join(r.Names(), ", "))
	}
	if deps.Rand == nil {
		deps.Rand = routing.NewRand(0)
	}
	deps.Clock = clock.Or(deps.Clock)
	if deps.Logger == nil {
		deps.Logger = slog.Default()
	}
	if deps.Config == nil {
		c := DefaultConfig()
		deps.Config = &c
	}
	return f(deps)
}

// Names lists the registered names, sorted.
func (r *Registry) Names() []string {
	names := make([]string, 0, len(r.factories))
	for n := range r.factories {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Default is the name of the default policy.
const Default = kvbandit.Name

// Builtin returns a registry holding every built-in policy.
func Builtin() *Registry {
	r := &Registry{}
	must := func(err error) {
		if err != nil {
			panic(err) // a programming error in this file
		}
	}
	must(r.Register(roundrobin.Name, func(Deps) (routing.Policy, error) { return roundrobin.New(), nil }))
	must(r.Register(leastloaded.Name, func(d Deps) (routing.Policy, error) { return leastloaded.New(d.Rand), nil }))
	must(r.Register(random.Name, func(d Deps) (routing.Policy, error) { return random.New(d.Rand), nil }))
	must(r.Register(kv.Name, func(d Deps) (routing.Policy, error) { return kv.New(d.Config.KV) }))
	must(r.Register(weighted.Name, func(d Deps) (routing.Policy, error) { return weighted.New(d.Config.Weighted) }))
	newKVBandit := func(d Deps, cost string) (routing.Policy, error) {
		var px kvbandit.Prefixes
		if d.Prefixes != nil {
			px = kvbandit.FromStore(d.Prefixes, d.Clock)
		}
		cfg := d.Config.KVBandit
		if cost != "" {
			cfg.Cost = cost
		}
		return kvbandit.New(cfg, px)
	}
	// kvbandit's cost comes from its config (ttft by default);
	// kvbandit_blocks is always the previous, block-counting formulation,
	// so that bench can compare the two side by side.
	must(r.Register(kvbandit.Name, func(d Deps) (routing.Policy, error) { return newKVBandit(d, "") }))
	must(r.Register(kvbandit.BlocksName, func(d Deps) (routing.Policy, error) { return newKVBandit(d, kvbandit.CostBlocks) }))
	must(r.Register(thompson.Name, func(d Deps) (routing.Policy, error) {
		td := thompson.Deps{Clock: d.Clock, Rand: d.Rand, Prefix: d.Prefixes, Logger: d.Logger}
		if d.OnReward != nil {
			td.OnReward = func(r thompson.Reward) { d.OnReward(r.Value) }
		}
		return thompson.New(d.Config.Thompson, td)
	}))
	return r
}
