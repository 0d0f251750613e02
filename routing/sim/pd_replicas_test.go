package sim

import (
	"fmt"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/pd"
)

// TestPDReplicasSeeBothEndpoints: four synced replicas in front of a P/D
// fleet (two prefill workers, four decode), sync applied at once: before
// every arrival every replica sees every worker's load as the others do
// (in-flight decisions, prefill tokens, held blocks), so a peer's
// disaggregated decision shows on its prefill worker with its prefill
// tokens and on its decode worker without them. Before the shared start
// carried the prefill endpoint, a prefill worker showed only the
// replica's own decisions.
func TestPDReplicasSeeBothEndpoints(t *testing.T) {
	reqs := synthetic(600, 8, 2048, 512, 25, 4)
	for _, policy := range []string{"kvbandit", "kv"} {
		cfg := Config{Workers: make([]WorkerConfig, 6), Policy: policy, KVEvents: true, Seed: 1, Replicas: 4, Sync: SyncNATS,
			Roles: []routing.Role{routing.RolePrefill, routing.RolePrefill, routing.RoleDecode, routing.RoleDecode, routing.RoleDecode, routing.RoleDecode},
			PD:    &pd.Config{ThresholdTokens: 0}}
		type view struct {
			fleet, prefill int64
			blocks         string
		}
		var checked, peersPrefill int
		cfg.probe = func(s *simulation, i int) {
			for w := range s.workers {
				var first view
				for r, rep := range s.reps {
					st := rep.eng.Endpoints()[w]
					v := view{st.FleetInFlight(), st.InFlightPrefill(), fmt.Sprint(st.ActiveBlocks())}
					if r == 0 {
						first = v
					} else if v != first {
						t.Fatalf("%s, before request %d: replica %d sees worker %d at %+v, replica 0 at %+v", policy, i, r, w, v, first)
					}
					if cfg.Roles[w] == routing.RolePrefill && st.RemoteInFlight.Load() > 0 && v.prefill > 0 {
						peersPrefill++
					}
					if cfg.Roles[w] == routing.RoleDecode && v.prefill != 0 {
						t.Fatalf("%s: decode worker %d holds %d prefill tokens", policy, w, v.prefill)
					}
				}
				checked++
			}
		}
		res, err := Run(t.Context(), cfg, reqs)
		if err != nil {
			t.Fatal(err)
		}
		disagg := 0
		for _, q := range res.Requests {
			if q.PrefillWorker >= 0 {
				disagg++
			}
		}
		t.Logf("%s: %d of %d disaggregated; %d views compared; peers' prefill seen %d times; sync errors %d", policy, disagg, len(reqs), checked, peersPrefill, res.SyncErrors)
		if disagg < len(reqs)/2 || peersPrefill == 0 || res.SyncErrors != 0 || res.SyncOpen != 0 {
			t.Fatalf("%s: %d disaggregated, peers' prefill seen %d times, sync errors %d, open %d", policy, disagg, peersPrefill, res.SyncErrors, res.SyncOpen)
		}
	}
}
