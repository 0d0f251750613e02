package extproc

import (
	"encoding/json"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

// TestStripKVTransferParams: the top-level kv_transfer_params goes, every
// copy and however its key is escaped; everything else stays byte for
// byte; a body without it is returned as is.
func TestStripKVTransferParams(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{"model":"m","kv_transfer_params":{"remote_host":"10.0.0.9","remote_port":5600},"stream":true}`, `{"model":"m","stream":true}`},
		{` { "kv_transfer_params" : {} , "model" : "m<&>\u2028" } `, `{"model" : "m<&>\u2028"}`},
		{`{"a":1,"kv_transfer_params":1,"b":[2],"kv_transfer_param\u0073":{"remote_host":"x"}}`, `{"a":1,"b":[2]}`},
		{`{"kv_transfer_params":null}`, `{}`},
		{`{"model":"m","nested":{"kv_transfer_params":{}}}`, ``},
		{`[{"kv_transfer_params":{}}]`, ``},
		{`{"model":"m"}`, ``},
	} {
		got, ok := StripKVTransferParams([]byte(c.in))
		if c.want == "" {
			if ok || string(got) != c.in {
				t.Errorf("%s: stripped to %s", c.in, got)
			}
			continue
		}
		if !ok || string(got) != c.want || !json.Valid(got) || len(got) >= len(c.in) {
			t.Errorf("%s:\n got %s (%v)\nwant %s", c.in, got, ok, c.want)
		}
	}
}

func TestStripsKVTransfer(t *testing.T) {
	pd := &routing.Decision{PD: routing.PDBelowThreshold}
	plain := &routing.Decision{PD: routing.PDNoPrefillEndpoints}
	if !StripsKVTransfer(pd, false) || StripsKVTransfer(plain, false) || !StripsKVTransfer(plain, true) {
		t.Error("strip only in P/D pools unless always")
	}
}
