package eds_test

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
)

// fakeEngine is the part of engine.Engine the hub drives; it records the
// sets it is given.
type fakeEngine struct {
	mu      sync.Mutex
	states  []*routing.EndpointState
	updates [][]string
}

func (e *fakeEngine) Update(set routing.EndpointSet) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	old := map[routing.EndpointKey]*routing.Live{}
	for _, st := range e.states {
		old[st.Key] = st.Live
	}
	e.states = nil
	var keys []string
	for _, ep := range set.Endpoints {
		live := old[ep.Key]
		if live == nil {
			live = &routing.Live{}
		}
		e.states = append(e.states, &routing.EndpointState{Endpoint: ep, Live: live})
		keys = append(keys, string(ep.Key))
	}
	e.updates = append(e.updates, keys)
	return nil
}

func (e *fakeEngine) Endpoints() []*routing.EndpointState {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.states)
}

// serving lists the keys the engine serves now.
func (e *fakeEngine) serving() []string {
	var out []string
	for _, st := range e.Endpoints() {
		out = append(out, string(st.Key))
	}
	return out
}

func (e *fakeEngine) state(key string) *routing.EndpointState {
	for _, st := range e.Endpoints() {
		if string(st.Key) == key {
			return st
		}
	}
	return nil
}

func set(keys ...string) routing.EndpointSet {
	return routing.EndpointSet{Source: "test", Endpoints: eps(keys...)}
}

// TestHubEngineFollowsACKs drives a real discovery.Hub with the EDS server as
// its gate: the engine's set grows only when Envoy has ACKed.
func TestHubEngineFollowsACKs(t *testing.T) {
	engine := &fakeEngine{}
	var hubp atomic.Pointer[discovery.Hub]
	f := start(t, eds.Config{}, func() { hubp.Load().Refresh() })
	hub := discovery.NewHub(discovery.HubDeps{Engine: engine, Gate: f.srv})
	hubp.Store(hub)

	// No Envoy yet: everything is pickable at once.
	if err := hub.Publish(set(a, b)); err != nil {
		t.Fatal(err)
	}
	if got := engine.serving(); !equal(got, []string{a, b}) {
		t.Fatalf("engine serves %v, want [%s %s]", got, a, b)
	}

	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)

	// c is offered; the engine must not pick it before Envoy has it.
	if err := hub.Publish(set(a, b, c)); err != nil {
		t.Fatal(err)
	}
	if got := engine.serving(); !equal(got, []string{a, b}) {
		t.Errorf("before the ACK the engine serves %v, want [%s %s]", got, a, b)
	}
	if st := hub.Stats(); st.Endpoints != 3 || st.Pickable != 2 {
		t.Errorf("hub stats: %d endpoints, %d pickable; want 3 and 2", st.Endpoints, st.Pickable)
	}
	resp := cl.recv()
	if got := keysOf(t, resp); !equal(got, []string{a, b, c}) {
		t.Fatalf("Envoy got %v", got)
	}
	cl.ack(resp)
	eventually(t, "the engine serves c", func() bool { return equal(engine.serving(), []string{a, b, c}) })

	// b leaves with a decision in flight: the engine drops it, Envoy keeps it
	// until the decision ends.
	bState := engine.state(b)
	bState.InFlight.Add(1)
	if err := hub.Publish(set(a, c)); err != nil {
		t.Fatal(err)
	}
	if got := engine.serving(); !equal(got, []string{a, c}) {
		t.Errorf("engine serves %v, want [%s %s]", got, a, c)
	}
	if v := f.srv.Stats().Version; v != 2 {
		t.Errorf("version %d, want still 2: b lingers in Envoy's cluster", v)
	}
	if st := hub.Stats(); st.Lingering != 1 {
		t.Errorf("hub: %d lingering, want 1", st.Lingering)
	}

	// The decision ends: b leaves Envoy's cluster too.
	bState.InFlight.Add(-1)
	hub.Refresh()
	resp = cl.recv()
	if got := keysOf(t, resp); resp.GetVersionInfo() != "3" || !equal(got, []string{a, c}) {
		t.Errorf("Envoy got version %s %v, want 3 [%s %s]", resp.GetVersionInfo(), got, a, c)
	}
	cl.ack(resp)
	ackedBy(t, f.srv, "envoy-1", 3)
	if got := engine.serving(); !equal(got, []string{a, c}) {
		t.Errorf("engine serves %v, want [%s %s]", got, a, c)
	}
}

// TestHubHoldsBackWhileTheFirstACKIsOnTheWay: an Envoy has been sent the
// first assignment and routes with it, but its ACK has not arrived. An
// endpoint published then must not reach the engine before Envoy's cluster
// has it (it did: with no ACK yet the gate let everything through).
func TestHubHoldsBackWhileTheFirstACKIsOnTheWay(t *testing.T) {
	engine := &fakeEngine{}
	var hubp atomic.Pointer[discovery.Hub]
	f := start(t, eds.Config{}, func() { hubp.Load().Refresh() })
	hub := discovery.NewHub(discovery.HubDeps{Engine: engine, Gate: f.srv})
	hubp.Store(hub)
	if err := hub.Publish(set(a, b)); err != nil {
		t.Fatal(err)
	}
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	v1 := cl.recv()
	if err := hub.Publish(set(a, b, c)); err != nil {
		t.Fatal(err)
	}
	if got := engine.serving(); !equal(got, []string{a, b}) {
		t.Errorf("Envoy holds version 1 (ACK on the way): engine serves %v, want [%s %s]", got, a, b)
	}
	cl.ack(v1)
	cl.ack(cl.recv())
	eventually(t, "the engine serves c", func() bool { return equal(engine.serving(), []string{a, b, c}) })
}
