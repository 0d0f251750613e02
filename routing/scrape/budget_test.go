package scrape_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/scrape"
)

// peakHeap samples the live heap objects every few milliseconds until
// stop is called, and returns the largest value seen.
func peakHeap() (stop func() uint64) {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	var (
		mu   sync.Mutex
		peak uint64
		done = make(chan struct{})
		wg   sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			metrics.Read(s)
			mu.Lock()
			peak = max(peak, s[0].Value.Uint64())
			mu.Unlock()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() uint64 {
		close(done)
		wg.Wait()
		return peak
	}
}

// TestHostileMetricsStayWithinBudget is the scrape channel's memory budget:
// 16 workers (the scraper's default concurrency) each answer a body just
// under the size limit made of hundreds of thousands of series — tiny
// unrelated ones, and series under the load names with distinct labels —
// and the process's heap must stay bounded while they are parsed.
func TestHostileMetricsStayWithinBudget(t *testing.T) {
	bodies := []string{hostileBody("junk_metric", scrape.DefaultMaxBody), hostileBody("vllm:num_requests_waiting", scrape.DefaultMaxBody)}
	var targets []scrape.Target
	for i := range 16 {
		body := bodies[i%2]
		// io.WriteString: the servers write the shared string without a
		// per-request copy, so the heap measures the scraper alone.
		targets = append(targets, newWorker(t, func(rw http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(rw, body) }).target())
	}
	var mu sync.Mutex
	errs := map[string]int{}
	s := scrape.New(scrape.Config{Timeout: 20 * time.Second}, scrape.Deps{
		Client:  newClient(t),
		Targets: func() []scrape.Target { return targets },
		OnError: func(_ scrape.Target, err error) {
			mu.Lock()
			errs[err.Error()[:min(40, len(err.Error()))]]++
			mu.Unlock()
		},
	})
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	base := m.HeapAlloc
	stop := peakHeap()
	s.ScrapeOnce(context.Background())
	peak := stop()
	t.Logf("peak heap %d MiB over %d MiB before; errors %v; stats %+v", (peak-base)>>20, base>>20, errs, s.Stats())
	// The bodies themselves (2 × 10 MiB, shared by the test's servers)
	// are in the baseline. Before the load lines were filtered, parsing
	// the 16 bodies peaked at 1.3 GiB.
	if grew := int64(peak) - int64(base); grew > 64<<20 {
		t.Fatalf("heap grew by %d MiB while scraping hostile workers (budget 64 MiB)", grew>>20)
	}
}

// hostileBody is a Prometheus text body of at most limit bytes made of one
// series per line under name, each with a distinct label value.
func hostileBody(name string, limit int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# TYPE %s gauge\n", strings.ReplaceAll(name, ":", "_"))
	for i := 0; ; i++ {
		line := fmt.Sprintf("%s{l=\"%d\"} 1\n", name, i)
		if int64(b.Len()+len(line)) > limit {
			return b.String()
		}
		b.WriteString(line)
	}
}
