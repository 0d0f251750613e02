// Package buildinfo says which kvbandit is running: its version, the commit
// it was built from and when it was built.
//
// make build and make image set the three at link time (see the variables
// below); a binary built without them (go build, go install, go test) falls
// back to what the Go toolchain recorded in it: the main module's version
// (v0.1.0 from go install …@v0.1.0, a pseudo-version from a build in a git
// checkout, (devel) otherwise), vcs.revision and vcs.time (the commit's
// time, not the build's). What nothing recorded reads "unknown".
package buildinfo

import (
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// The link-time values, e.g.
//
//	go build -ldflags "-X github.com/kvbandit/kvbandit/internal/buildinfo.version=v0.1.0
//	  -X github.com/kvbandit/kvbandit/internal/buildinfo.commit=$(git rev-parse HEAD)
//	  -X github.com/kvbandit/kvbandit/internal/buildinfo.date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
//
// -X can only set package-level string variables: these are the package's
// only state, written by the linker and never by code.
var version, commit, date string

// Unknown stands for a value nothing recorded.
const Unknown = "unknown"

// Info describes one build of kvbandit.
type Info struct {
	// Version is the release (v0.1.0), a git describe string
	// (v0.1.0-3-gabc1234-dirty), Go's module version or "(devel)".
	Version string
	// Commit is the full git revision.
	Commit string
	// Date is the build time in RFC 3339 (from the link-time value), or the
	// commit time that Go recorded.
	Date string
	// GoVersion is the toolchain that built the binary (go1.26.8).
	GoVersion string
}

// Read returns the running binary's build information.
func Read() Info {
	bi, _ := debug.ReadBuildInfo()
	return resolve(version, commit, date, bi)
}

// resolve prefers the link-time values and falls back to bi (nil: no build
// information) field by field.
func resolve(v, c, d string, bi *debug.BuildInfo) Info {
	i := Info{Version: v, Commit: c, Date: d, GoVersion: runtime.Version()}
	if bi != nil {
		if i.Version == "" {
			i.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision" && i.Commit == "":
				i.Commit = s.Value
			case s.Key == "vcs.time" && i.Date == "":
				i.Date = s.Value
			}
		}
		if bi.GoVersion != "" {
			i.GoVersion = bi.GoVersion
		}
	}
	if i.Version == "" {
		i.Version = "(devel)"
	}
	if i.Commit == "" {
		i.Commit = Unknown
	}
	if i.Date == "" {
		i.Date = Unknown
	}
	return i
}

// Collector returns the kvbandit_build_info gauge: always 1, with the
// build's version, commit, date and goversion as labels (the Prometheus
// convention for build information, joined to other series with
// `* on(instance) group_left(version)`).
func (i Info) Collector() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvbandit_build_info",
		Help: "Always 1; the labels say which build of kvbandit is running.",
		ConstLabels: prometheus.Labels{
			"version": i.Version, "commit": i.Commit, "date": i.Date, "goversion": i.GoVersion,
		},
	})
	g.Set(1)
	return g
}
