package app

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// runConfig is `kvbandit config check FILE [serve flags]`: serve's
// start-up checks of a config file (and of any serve flags given with it)
// without serving.
func runConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	// usage follows ErrUsage ("usage: ...") in errors.
	const usage = "kvbandit config check FILE [serve flags]"
	fs := flag.NewFlagSet("config check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage:", usage)
		fs.PrintDefaults()
	}
	var o ServeOptions
	o.AddFlags(fs)
	if len(args) == 0 || args[0] != "check" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fs.Usage()
			return flag.ErrHelp
		}
		return fmt.Errorf("%w: %s", ErrUsage, usage)
	}
	args = args[1:]
	var file string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		file, args = args[0], args[1:]
	}
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if file == "" && fs.NArg() == 1 {
		file = fs.Arg(0)
	} else if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q; %s", ErrUsage, fs.Args(), usage)
	}
	if file == "" {
		return fmt.Errorf("%w: %s", ErrUsage, usage)
	}
	o.set = map[string]string{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = f.Value.String() })
	o.ConfigPath = file
	return checkConfig(o, stdout, stderr, false)
}

// checkConfig does what serve does before it binds a port: load and
// validate the config file, apply the flags, check the policy, build the
// discovery source (etcd and Kubernetes settings are parsed and their
// clients configured; nothing is contacted) and load every configured
// tokenizer. On success it prints the effective config as YAML, secrets
// redacted, after a comment block that sums up what was checked. With
// needWorkers (serve --dry-run) a missing source of endpoints is an error;
// config check only notes it.
func checkConfig(o ServeOptions, stdout, stderr io.Writer, needWorkers bool) error {
	log := newLogger(stderr, cmp.Or(o.LogLevel, "warn"), cmp.Or(o.LogFormat, "text"))
	cfg := DefaultFileConfig()
	if o.ConfigPath != "" {
		c, err := LoadConfig(o.ConfigPath)
		if err != nil {
			return err
		}
		cfg = *c
	}
	if err := o.applyFlags(&cfg); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if err := checkSyncCredentials(o, &cfg); err != nil {
		return err
	}
	var notes []string
	if !slices.Contains(policy.Builtin().Names(), o.Policy) {
		return fmt.Errorf("%w: --policy %q: want one of %s", ErrUsage, o.Policy, strings.Join(policy.Builtin().Names(), ", "))
	}
	notes = append(notes, "policy: "+o.Policy)

	hasSource := len(cfg.Endpoints) > 0 || cfg.Discovery.File != nil || cfg.Discovery.Etcd != nil || cfg.Discovery.Kube != nil ||
		o.Endpoints != "" || o.EndpointsFile != "" || o.EtcdEndpoints != "" || o.PoolName != "" || o.KubeSelector != ""
	switch {
	case hasSource || needWorkers:
		static, sources, _, err := discoverySources(o, &cfg, log)
		if err != nil {
			return fmt.Errorf("%w: discovery: %w", ErrConfig, err)
		}
		if static != nil {
			if err := static.Validate(); err != nil {
				return fmt.Errorf("%w: endpoints: %w", ErrConfig, err)
			}
			notes = append(notes, fmt.Sprintf("discovery: static, %d endpoints", len(static.Endpoints)))
		}
		for _, s := range sources {
			notes = append(notes, "discovery: "+s.Name()+" (settings parsed; not contacted)")
		}
	default:
		notes = append(notes, "discovery: none in the file (serve needs --endpoints, --endpoints-file, --etcd-endpoints, --pool-name or --kube-selector)")
	}

	treg := tokenizerRegistry(o.Tokenizer, &cfg, log)
	loaded, err := loadTokenizers(treg, o.Tokenizer, &cfg)
	if err != nil {
		return err
	}
	if len(loaded) == 0 {
		loaded = []string{"none (prompts are hashed from a byte estimate)"}
	}
	for _, l := range loaded {
		notes = append(notes, "tokenizer: "+l)
	}

	out, err := yaml.Marshal(redacted(cfg))
	if err != nil {
		return fmt.Errorf("printing the config: %w", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# kvbandit config check: OK (%s)\n", cmp.Or(o.ConfigPath, "no config file"))
	for _, n := range notes {
		b.WriteString("# " + n + "\n")
	}
	b.Write(out)
	_, err = io.WriteString(stdout, b.String())
	return err
}

// loadTokenizers loads the default tokenizer (--tokenizer) and every
// model's, so that a path that cannot be loaded is a start-up error. It
// returns one line per tokenizer loaded ("model: path").
func loadTokenizers(treg *models.Registry, def string, cfg *FileConfig) ([]string, error) {
	var lines []string
	if def != "" {
		if _, err := treg.For(""); err != nil {
			return nil, fmt.Errorf("%w: --tokenizer %s: %w", ErrUsage, def, err)
		}
		lines = append(lines, "default: "+def)
	}
	names := make([]string, 0, len(cfg.Models))
	for name := range cfg.Models {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if _, err := treg.For(name); err != nil {
			return nil, fmt.Errorf("%w: models[%q].tokenizer %s: %w", ErrConfig, name, cfg.Models[name].Tokenizer, err)
		}
		lines = append(lines, fmt.Sprintf("%s: %s", name, cfg.Models[name].Tokenizer))
	}
	return lines, nil
}

// redacted returns c with passwords and tokens replaced, for printing.
func redacted(c FileConfig) FileConfig {
	const hidden = "REDACTED"
	hide := func(s *string) {
		if *s != "" {
			*s = hidden
		}
	}
	hide(&c.Sync.NATS.Password)
	hide(&c.Sync.NATS.Token)
	if c.Discovery.Etcd != nil {
		e := *c.Discovery.Etcd
		hide(&e.Password)
		c.Discovery.Etcd = &e
	}
	return c
}
