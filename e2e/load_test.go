package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/extprocload"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

// TestOpenLoopLoad drives the binary with the open-loop ext_proc load the
// side-by-side benchmark uses (distinct 4 KB chat bodies), checks that every
// answer carries a valid destination, and that the process accounting the
// benchmark reports can be read.
func TestOpenLoopLoad(t *testing.T) {
	_, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs, "--policy", "kvbandit", "--scrape-interval", "0")
	before, err := extprocload.ReadUsage(k.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	res, err := extprocload.Run(t.Context(), extprocload.Config{
		Addr: k.grpcAddr, Rate: 200, Duration: 2 * time.Second,
		Bodies: extprocload.ChatBodies(400, 4096, "test-model"),
	})
	if err != nil {
		t.Fatal(err)
	}
	after, err := extprocload.ReadUsage(k.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if res.OK != res.Sent || res.Dropped != 0 || len(res.Errors) != 0 {
		t.Fatalf("sent %d, ok %d, dropped %d, errors %v", res.Sent, res.OK, res.Dropped, res.Errors)
	}
	if after.CPU <= before.CPU || after.PeakRSS <= 0 {
		t.Fatalf("usage before %+v after %+v", before, after)
	}
	t.Logf("kvbandit (race build) at 200 req/s: p50 %v p99 %v, %.1f ms CPU per 1000 requests, peak RSS %d MiB",
		res.Quantile(0.5), res.Quantile(0.99), float64((after.CPU-before.CPU).Milliseconds())*1000/float64(res.OK), after.PeakRSS>>20)
}

// waitPicking waits until the picker at addr answers a request with a
// destination (the open-loop load's definition of an answer); out is its
// output, shown on failure.
func waitPicking(t *testing.T, name, addr string, out fmt.Stringer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		r, err := extprocload.Run(ctx, extprocload.Config{Addr: addr, Rate: 20, Duration: 100 * time.Millisecond, Bodies: extprocload.ChatBodies(2, 4096, "test-model"), Timeout: 2 * time.Second})
		if err != nil {
			return false, err.Error()
		}
		return r.OK == r.Sent && r.Sent > 0, fmt.Sprint(r.Errors)
	}); err != nil {
		t.Fatalf("%s not answering: %v\n%s", name, err, out)
	}
}
