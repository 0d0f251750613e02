package discovery_test

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// heapAfterGC is the live heap after a collection.
func heapAfterGC() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestHostileRecordsStayWithinBudget is the discovery channel's memory
// budget: endpoint files (what a ConfigMap or an etcd writer controls)
// declaring huge data-parallel sizes, many models, labels and oversized
// records, and a set over the size limit, published through the hub into
// a real engine. Before the limits, one record declaring 4M data-parallel
// ranks made the engine allocate a rank state for each (~1 GB).
func TestHostileRecordsStayWithinBudget(t *testing.T) {
	e := newEngine(t)
	h := discovery.NewHub(discovery.HubDeps{Engine: e})
	if err := h.Publish(set("file", "10.0.0.1:8000")); err != nil {
		t.Fatal(err)
	}
	base := heapAfterGC()

	var b strings.Builder
	b.WriteString("endpoints:\n")
	b.WriteString("- address: 10.1.0.1:8000\n  data_parallel_size: 4000000\n")
	for i := range 64 {
		fmt.Fprintf(&b, "- address: 10.1.1.%d:8000\n  block_size: 1000000000\n", i+1)
	}
	many := make([]string, 20000)
	for i := range many {
		many[i] = fmt.Sprintf("model-%d", i)
	}
	fmt.Fprintf(&b, "- address: 10.2.0.1:8000\n  models: [%s]\n", strings.Join(many, ","))
	fmt.Fprintf(&b, "- address: 10.2.0.2:8000\n  labels: {k: %q}\n", strings.Repeat("v", 4<<20))
	hostile := b.String()

	set, err := discovery.ParseEndpointsFile([]byte(hostile), nil)
	if err != nil {
		t.Fatal(err)
	}
	accepted := len(set.Endpoints)
	if accepted > 0 {
		_ = h.Publish(set)
	}
	// A whole set over MaxEndpoints is refused; the last good set stays.
	big := routing.EndpointSet{Source: "file"}
	for i := range routing.MaxEndpoints + 1 {
		big.Endpoints = append(big.Endpoints, routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.%d.%d.%d:8000", 10+i>>16, i>>8&255, i&255))})
	}
	if err := h.Publish(big); err == nil {
		t.Fatal("a set over MaxEndpoints was published")
	}
	// Records that pass each get their own rank state: the largest legal
	// data-parallel size, many times.
	legal := routing.EndpointSet{Source: "file"}
	for i := range 32 {
		legal.Endpoints = append(legal.Endpoints, routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.3.0.%d:8000", i+1)), DataParallelSize: routing.MaxDataParallelSize})
	}
	if err := h.Publish(legal); err != nil {
		t.Fatal(err)
	}
	set, hostile, big = routing.EndpointSet{}, "", routing.EndpointSet{}
	if grew := int64(heapAfterGC()) - int64(base); grew > 64<<20 {
		t.Fatalf("heap grew by %d MiB publishing hostile discovery records (budget 64 MiB)", grew>>20)
	}
	if accepted != 0 {
		t.Fatalf("%d hostile records were accepted", accepted)
	}
	if n := len(e.Endpoints()); n != 32 {
		t.Fatalf("engine has %d endpoints, want the 32 legal ones", n)
	}
}
