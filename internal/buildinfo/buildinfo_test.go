package buildinfo

import (
	"maps"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestResolve(t *testing.T) {
	vcs := &debug.BuildInfo{
		GoVersion: "go1.26.8",
		Main:      debug.Module{Path: "github.com/kvbandit/kvbandit", Version: "v0.0.0-20261126230000-0123456789ab+dirty"},
		Settings: []debug.BuildSetting{
			{Key: "-trimpath", Value: "true"},
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
			{Key: "vcs.time", Value: "2026-11-26T23:00:00Z"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
	cases := []struct {
		name    string
		v, c, d string
		bi      *debug.BuildInfo
		want    Info
	}{
		{"link-time values win", "v0.1.0", "fedcba", "2026-11-27T10:00:00Z", vcs,
			Info{"v0.1.0", "fedcba", "2026-11-27T10:00:00Z", "go1.26.8"}},
		{"go build in a checkout", "", "", "", vcs,
			Info{"v0.0.0-20261126230000-0123456789ab+dirty", "0123456789abcdef0123456789abcdef01234567", "2026-11-26T23:00:00Z", "go1.26.8"}},
		{"only the version at link time", "v0.2.0", "", "", vcs,
			Info{"v0.2.0", "0123456789abcdef0123456789abcdef01234567", "2026-11-26T23:00:00Z", "go1.26.8"}},
		{"go install module@version (no VCS)", "", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.1.0"}},
			Info{"v0.1.0", Unknown, Unknown, "go1.26.8"}},
		{"test binary", "", "", "", &debug.BuildInfo{GoVersion: "go1.26.8"},
			Info{"(devel)", Unknown, Unknown, "go1.26.8"}},
		{"no build info", "", "", "", nil,
			Info{"(devel)", Unknown, Unknown, runtime.Version()}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := resolve(c.v, c.c, c.d, c.bi); got != c.want {
				t.Fatalf("got %+v\nwant %+v", got, c.want)
			}
		})
	}
}

// TestRead reads this test binary, which has no link-time values and no
// VCS information: the fallbacks fill every field.
func TestRead(t *testing.T) {
	i := Read()
	if i.Version == "" || i.Commit == "" || i.Date == "" || i.GoVersion != runtime.Version() {
		t.Fatalf("%+v", i)
	}
}

func TestCollector(t *testing.T) {
	reg := prometheus.NewRegistry()
	i := Info{Version: "v0.1.0", Commit: "abc", Date: "2026-11-27T10:00:00Z", GoVersion: "go1.26.8"}
	reg.MustRegister(i.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != 1 || mfs[0].GetName() != "kvbandit_build_info" || len(mfs[0].GetMetric()) != 1 {
		t.Fatalf("%v", mfs)
	}
	m := mfs[0].GetMetric()[0]
	if m.GetGauge().GetValue() != 1 {
		t.Fatalf("value %v, want 1", m.GetGauge().GetValue())
	}
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	want := map[string]string{"version": "v0.1.0", "commit": "abc", "date": "2026-11-27T10:00:00Z", "goversion": "go1.26.8"}
	if !maps.Equal(got, want) {
		t.Fatalf("labels %v, want %v", got, want)
	}
}
