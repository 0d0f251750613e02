// Package cmdline is what kvbandit's subcommands share to read their
// command line: the usage-error sentinel that maps to exit code 2, and the
// flag parsing that wraps parse errors in it.
package cmdline

import (
	"errors"
	"flag"
	"fmt"
)

// ErrUsage marks command-line mistakes (exit code 2).
var ErrUsage = errors.New("usage")

// ParseFlags parses a subcommand's flags: -h/--help passes flag.ErrHelp
// through (exit 0 after the usage), any other parse error is a usage error.
func ParseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return nil
}
