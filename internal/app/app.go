// Package app implements kvbandit's command line: the command table
// ([Run]), flag parsing, the wiring of the servers serve runs (the
// start-up sequence in serve.go, its servers in serve_servers.go, the
// drain in serve_shutdown.go, the engine in wiring.go), and the
// subcommands (demo, config, envoy-config, register, tokenize, version).
// `kvbandit bench` is package benchcmd, which the command table calls with
// serve's config loader. main only installs signal handling and calls
// [Run].
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"strings"

	"github.com/kvbandit/kvbandit/internal/benchcmd"
	"github.com/kvbandit/kvbandit/internal/buildinfo"
	"github.com/kvbandit/kvbandit/internal/cmdline"
)

// ErrUsage marks command-line mistakes (exit code 2). It is
// [cmdline.ErrUsage], which the subcommands in their own packages
// (benchcmd) wrap too.
var ErrUsage = cmdline.ErrUsage

// ExitCode maps an error from Run to a process exit code.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrUsage), errors.Is(err, flag.ErrHelp):
		return 2
	}
	return 1
}

type command struct {
	summary string
	run     func(ctx context.Context, args []string, std stdio) error
}

// stdio are a command's standard streams.
type stdio struct {
	in       io.Reader
	out, err io.Writer
}

func commands() map[string]command {
	return map[string]command{
		"serve":        {"run the ext_proc endpoint picker", func(ctx context.Context, a []string, s stdio) error { return runServe(ctx, a, s.out, s.err) }},
		"bench":        {"replay a trace on a simulated vLLM fleet under each policy and compare", func(ctx context.Context, a []string, s stdio) error { return runBench(ctx, a, s.out, s.err) }},
		"demo":         {"start a simulated fleet of 4 workers and serve in front of it, send a burst of agent sessions and the same burst against a round_robin baseline, then keep serving", func(ctx context.Context, a []string, s stdio) error { return runDemo(ctx, a, s.out, s.err) }},
		"config":       {"check a config file (and serve flags): load, validate, resolve tokenizers and discovery settings, print the effective config", func(ctx context.Context, a []string, s stdio) error { return runConfig(ctx, a, s.out, s.err) }},
		"envoy-config": {"print a validated Envoy bootstrap for a list of workers", func(ctx context.Context, a []string, s stdio) error { return runEnvoyConfig(ctx, a, s.out, s.err) }},
		"register":     {"keep a worker's endpoint record in etcd while it is healthy (deleted on exit)", func(ctx context.Context, a []string, s stdio) error { return runRegister(ctx, a, s.out, s.err) }},
		"tokenize":     {"print the token ids of stdin (text, or an OpenAI chat request with --chat)", func(ctx context.Context, a []string, s stdio) error { return runTokenize(ctx, a, s.in, s.out, s.err) }},
		"version":      {"print the version, commit and build date", func(ctx context.Context, a []string, s stdio) error { return runVersion(ctx, a, s.out, s.err) }},
	}
}

// Run executes the subcommand named by args[0] with the process's stdin.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return RunIO(ctx, args, os.Stdin, stdout, stderr)
}

// RunIO is Run with an explicit stdin.
func RunIO(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	cmds := commands()
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stderr, cmds)
		if len(args) == 0 {
			return fmt.Errorf("%w: no command", ErrUsage)
		}
		return nil
	}
	if args[0] == "--version" || args[0] == "-version" {
		return runVersion(ctx, args[1:], stdout, stderr)
	}
	c, ok := cmds[args[0]]
	if !ok {
		usage(stderr, cmds)
		return fmt.Errorf("%w: unknown command %q", ErrUsage, args[0])
	}
	err := c.run(ctx, args[1:], stdio{in: stdin, out: stdout, err: stderr})
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

func usage(w io.Writer, cmds map[string]command) {
	names := make([]string, 0, len(cmds))
	for n := range cmds {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteString("kvbandit: the KV-cache-aware inference router for Envoy (ext_proc endpoint picker)\n\nUsage: kvbandit <command> [flags]\n       kvbandit --version\n\nCommands:\n")
	for _, n := range names {
		fmt.Fprintf(&b, "  %-13s %s\n", n, cmds[n].summary)
	}
	b.WriteString("\nRun 'kvbandit <command> -h' for a command's flags.\n")
	io.WriteString(w, b.String())
}

func runVersion(_ context.Context, args []string, stdout, _ io.Writer) error {
	if len(args) > 0 {
		return fmt.Errorf("%w: version takes no arguments", ErrUsage)
	}
	printVersion(stdout, buildinfo.Read())
	return nil
}

// printVersion writes what `kvbandit version` and `kvbandit --version`
// print: "kvbandit VERSION" on the first line, then the commit, the build
// date and the toolchain.
func printVersion(w io.Writer, bi buildinfo.Info) {
	fmt.Fprintf(w, "kvbandit %s\ncommit: %s\nbuilt:  %s\ngo:     %s %s/%s\n", bi.Version, bi.Commit, bi.Date, bi.GoVersion, runtime.GOOS, runtime.GOARCH)
}

// runBench is `kvbandit bench` (internal/benchcmd), whose --config is
// read as serve reads it.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return benchcmd.Run(ctx, args, stdout, stderr, benchConfig)
}

// benchConfig is bench's --config loader: serve's config file, read as
// serve reads it, gives bench its policy sections and tier weights.
func benchConfig(path string) (benchcmd.ConfigFile, error) {
	c, err := LoadConfig(path)
	if err != nil {
		return benchcmd.ConfigFile{}, err
	}
	return benchcmd.ConfigFile{Policies: &c.Config, TierWeights: c.Router.TierWeights}, nil
}
