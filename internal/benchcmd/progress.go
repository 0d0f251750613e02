package benchcmd

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Progress redraw intervals: a terminal line is redrawn often; forced
// progress on a file or pipe prints a line now and then.
const (
	progressTTYEvery  = 250 * time.Millisecond
	progressLineEvery = 5 * time.Second
)

// benchProgress shows on stderr how far each policy's replay is: requests
// routed of the trace's, per running policy, and an ETA from the overall
// rate. On a terminal it redraws one line; elsewhere (--progress) it prints
// a line every progressLineEvery. A nil *benchProgress does nothing.
type benchProgress struct {
	w     io.Writer
	tty   bool
	every time.Duration
	now   func() time.Time
	names []string
	total int // requests per policy
	began time.Time
	// arrived, started and finished are written by the policies'
	// goroutines.
	arrived           []atomic.Int64
	started, finished []atomic.Bool
	stop              chan struct{}
	wg                sync.WaitGroup
	// width is the length of the last line drawn on a terminal.
	width int
}

// newBenchProgress returns the progress display for names replaying total
// requests each, or nil when it is off: with quiet, or when w is not a
// terminal unless forced. Call start, then close.
func newBenchProgress(w io.Writer, quiet, forced bool, names []string, total int, now func() time.Time) *benchProgress {
	tty := isTerminal(w)
	if quiet || (!tty && !forced) || len(names) == 0 {
		return nil
	}
	if now == nil {
		now = time.Now
	}
	p := &benchProgress{
		w: w, tty: tty, every: progressLineEvery, now: now, names: names, total: total,
		arrived: make([]atomic.Int64, len(names)), started: make([]atomic.Bool, len(names)), finished: make([]atomic.Bool, len(names)),
		stop: make(chan struct{}),
	}
	if tty {
		p.every = progressTTYEvery
	}
	return p
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// start prints the first line and redraws until close.
func (p *benchProgress) start() {
	if p == nil {
		return
	}
	p.began = p.now()
	p.draw()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		t := time.NewTicker(p.every)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
				p.draw()
			}
		}
	}()
}

// arrivedFunc marks policy i started and returns its sim.Config.Progress
// (nil when off).
func (p *benchProgress) arrivedFunc(i int) func(int) {
	if p == nil {
		return nil
	}
	p.started[i].Store(true)
	return func(n int) { p.arrived[i].Store(int64(n)) }
}

// done marks policy i finished.
func (p *benchProgress) done(i int) {
	if p != nil {
		p.arrived[i].Store(int64(p.total))
		p.finished[i].Store(true)
	}
}

// close stops the redraws and prints the final line.
func (p *benchProgress) close() {
	if p == nil {
		return
	}
	close(p.stop)
	p.wg.Wait()
	line := fmt.Sprintf("bench: %d %s × %d requests replayed in %s", len(p.names), plural(len(p.names), "policy", "policies"), p.total, p.now().Sub(p.began).Round(100*time.Millisecond))
	if p.tty {
		fmt.Fprintf(p.w, "\r%-*s\n", p.width, line)
		return
	}
	fmt.Fprintln(p.w, line)
}

// draw writes the current line.
func (p *benchProgress) draw() {
	line := p.line()
	if !p.tty {
		fmt.Fprintln(p.w, line)
		return
	}
	// Pad over the previous line instead of an escape sequence, so a
	// terminal without ANSI support shows it right too.
	fmt.Fprintf(p.w, "\r%-*s", p.width, line)
	p.width = max(p.width, len(line))
}

// line is "bench: kvbandit 1280/5000, kv 768/5000; 2 of 7 policies done; ETA 12s".
func (p *benchProgress) line() string {
	var b strings.Builder
	b.WriteString("bench: ")
	var all int64
	finished, running := 0, 0
	for i, name := range p.names {
		n := p.arrived[i].Load()
		all += n
		switch {
		case p.finished[i].Load():
			finished++
		case p.started[i].Load():
			if running > 0 {
				b.WriteString(", ")
			}
			running++
			fmt.Fprintf(&b, "%s %d/%d", name, n, p.total)
		}
	}
	if running > 0 {
		b.WriteString("; ")
	}
	fmt.Fprintf(&b, "%d of %d %s done; ETA ", finished, len(p.names), plural(len(p.names), "policy", "policies"))
	b.WriteString(p.eta(all))
	return b.String()
}

// eta extrapolates the time left from the requests routed so far across
// every policy (they run up to GOMAXPROCS at a time).
func (p *benchProgress) eta(arrived int64) string {
	want := int64(p.total) * int64(len(p.names))
	elapsed := p.now().Sub(p.began)
	if arrived <= 0 || elapsed <= 0 {
		return "-"
	}
	left := time.Duration(float64(elapsed) * float64(want-arrived) / float64(arrived))
	return left.Round(time.Second).String()
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
