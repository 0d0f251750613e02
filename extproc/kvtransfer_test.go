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

// FuzzStripKVTransferParams: on any input, no panic; a stripped body is
// strict JSON, shorter, with no top-level kv_transfer_params once decoded
// (as Python's json module reads it: keys unescaped, the last copy wins)
// and every other top-level member kept.
func FuzzStripKVTransferParams(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","kv_transfer_params":{"remote_host":"10.0.0.9"}}`,
		` {"kv_transfer_param\u0073":1,"a":[1,{"kv_transfer_params":2}]} `,
		`{"kv_transfer_params":1,"kv_transfer_params":2}`,
		`{}`, `[]`, `"kv_transfer_params"`, `{"a":`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		out, ok := StripKVTransferParams(body)
		if !ok {
			if string(out) != string(body) {
				t.Fatalf("not stripped, but changed: %q -> %q", body, out)
			}
			return
		}
		var in, got map[string]json.RawMessage
		if json.Unmarshal(body, &in) != nil || json.Unmarshal(out, &got) != nil || !json.Valid(out) {
			t.Fatalf("stripped %q to invalid %q", body, out)
		}
		if len(out) >= len(body) {
			t.Fatalf("stripped body grew: %q -> %q", body, out)
		}
		if _, ok := got[FieldKVTransferParams]; ok {
			t.Fatalf("kv_transfer_params left in %q", out)
		}
		delete(in, FieldKVTransferParams)
		if len(in) != len(got) {
			t.Fatalf("members lost: %q -> %q", body, out)
		}
		for k, v := range in {
			if string(got[k]) != string(v) {
				t.Fatalf("member %q changed: %s -> %s", k, v, got[k])
			}
		}
	})
}
