package benchcmd

import (
	"time"
)

// How often the workers' load reaches each policy's engine when
// --scrape-interval is not given: as each is deployed. `weighted` is our
// reading of GIE's EPP, which refreshes its metrics every 50 ms (v1.5.0's
// --refresh-metrics-interval default); every other policy runs in serve,
// which scrapes every second. Load that arrives after every change
// (--scrape-interval 0) flatters a policy that reads queue depths only
// from the workers' metrics: `make bench-live` showed GIE's EPP behind
// round_robin on the Mooncake slice, as `weighted` is at 50 ms, while at
// 0 it was ahead.
const (
	gieScrapeInterval   = 50 * time.Millisecond
	serveScrapeInterval = time.Second
)

// scrapeFlag is --scrape-interval: a duration, or unset for each policy
// as deployed.
type scrapeFlag struct {
	d   time.Duration
	set bool
}

func (f *scrapeFlag) String() string {
	if f == nil || !f.set {
		return ""
	}
	return f.d.String()
}

func (f *scrapeFlag) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	f.d, f.set = d, true
	return nil
}

// interval is the scrape interval of policy's engine.
func (f scrapeFlag) interval(policy string) time.Duration {
	switch {
	case f.set:
		return f.d
	case policy == "weighted":
		return gieScrapeInterval
	}
	return serveScrapeInterval
}
