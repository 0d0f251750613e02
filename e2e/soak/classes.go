package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Load class groups.
const (
	groupNormal         = "normal"          // must succeed: measures service
	groupClientErrors   = "client-errors"   // cancels, bad requests: a definite answer expected
	groupHostileHTTP    = "hostile-http"    // raw HTTP against the standalone proxy and envoysim
	groupHostileExtProc = "hostile-extproc" // raw ext_proc streams
	groupKV             = "kv-events"       // floods and hostile ZMTP peers
)

// class is one kind of load: a Poisson arrival process at rate per second
// with at most maxOpen requests open (arrivals beyond are skipped).
type class struct {
	name    string
	group   string
	rate    float64
	maxOpen int
	about   string
	// do runs one request; rng is its own.
	do func(ctx context.Context, rng *rand.Rand) result
	// loop, instead of do, runs the class as one long-lived loop.
	loop func(ctx context.Context, t *tally)

	t *tally
}

// resultKind classifies one request.
type resultKind int

const (
	resultOK resultKind = iota
	resultFailed
	resultSkipped
)

// result is one request's outcome; reason says why it failed or was
// skipped.
type result struct {
	kind   resultKind
	reason string
}

func ok() result { return result{kind: resultOK} }

func failf(format string, args ...any) result {
	return result{kind: resultFailed, reason: fmt.Sprintf(format, args...)}
}

func skipped(reason string) result { return result{kind: resultSkipped, reason: reason} }

// tally counts one class's results. Failure reasons are kept per distinct
// text, at most maxReasons of them (the rest are "other").
type tally struct {
	okN, failedN, skippedN atomic.Int64
	open                   atomic.Int64 // requests running now

	mu      sync.Mutex
	reasons map[string]int64
	skips   map[string]int64
}

const maxReasons = 12

func newTally() *tally {
	return &tally{reasons: map[string]int64{}, skips: map[string]int64{}}
}

func (t *tally) add(r result) {
	switch r.kind {
	case resultOK:
		t.okN.Add(1)
	case resultFailed:
		t.fail(r.reason)
	case resultSkipped:
		t.skip(r.reason)
	}
}

func (t *tally) ok() { t.okN.Add(1) }

func (t *tally) fail(reason string) {
	t.failedN.Add(1)
	t.note(t.reasons, reason)
}

func (t *tally) skip(reason string) {
	t.skippedN.Add(1)
	t.note(t.skips, reason)
}

func (t *tally) note(m map[string]int64, reason string) {
	reason = shorten(reason, 120)
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, seen := m[reason]; !seen && len(m) >= maxReasons {
		reason = "other"
	}
	m[reason]++
}

// topReasons returns the n most frequent failure reasons, "count× reason".
func (t *tally) topReasons(n int) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	type kv struct {
		k string
		v int64
	}
	var all []kv
	for k, v := range t.reasons {
		all = append(all, kv{k, v})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].v > all[j].v || all[i].v == all[j].v && all[i].k < all[j].k })
	var out []string
	for i := 0; i < len(all) && i < n; i++ {
		out = append(out, fmt.Sprintf("%d× %s", all[i].v, all[i].k))
	}
	return out
}

// shorten cuts s to n bytes (on a rune boundary) with an ellipsis, and
// folds it to one line.
func shorten(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	for n > 0 && !isRuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

func isRuneStart(b byte) bool { return b&0xc0 != 0x80 }

// runClass drives c until ctx ends and returns when every request it
// started has returned. Requests get reqCtx-derived contexts bounded by
// timeout; results that arrive after ctx ended are not counted (the load
// was stopped under them).
func runClass(ctx context.Context, c *class, seed uint64, timeout time.Duration) {
	if c.loop != nil {
		c.loop(ctx, c.t)
		return
	}
	if c.rate <= 0 {
		return
	}
	rng := rand.New(rand.NewPCG(seed, 0x50a4))
	sem := make(chan struct{}, max(c.maxOpen, 1))
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for {
		// Exponential inter-arrival times: an open-loop Poisson process.
		timer.Reset(time.Duration(rng.ExpFloat64() / c.rate * float64(time.Second)))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		select {
		case sem <- struct{}{}:
		default:
			c.t.skip(fmt.Sprintf("%d requests of the class already open", cap(sem)))
			continue
		}
		reqRng := rand.New(rand.NewPCG(rng.Uint64(), rng.Uint64()))
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			rctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			c.t.open.Add(1)
			r := c.do(rctx, reqRng)
			c.t.open.Add(-1)
			if ctx.Err() != nil {
				return // stopped under the request: not counted
			}
			c.t.add(r)
		}()
	}
}
