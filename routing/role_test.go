package routing

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseRole(t *testing.T) {
	for in, want := range map[string]Role{"": RoleBoth, "both": RoleBoth, "Prefill-Decode": RoleBoth, " prefill ": RolePrefill, "PREFILL": RolePrefill, "decode": RoleDecode} {
		got, err := ParseRole(in)
		if err != nil || got != want {
			t.Errorf("ParseRole(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"encode", "prefill,decode", strings.Repeat("x", 10000)} {
		_, err := ParseRole(in)
		if !errors.Is(err, ErrUnknownRole) || len(err.Error()) > 200 {
			t.Errorf("ParseRole(%.20q): %v", in, err)
		}
	}
	for r, s := range map[Role]string{RoleBoth: "both", RolePrefill: "prefill", RoleDecode: "decode"} {
		if r.String() != s {
			t.Errorf("%d.String() = %q", r, r.String())
		}
		if back, err := ParseRole(s); err != nil || back != r {
			t.Errorf("round trip %q: %v %v", s, back, err)
		}
	}
	if !RoleBoth.Prefills() || !RoleBoth.Decodes() || RoleDecode.Prefills() || RolePrefill.Decodes() {
		t.Error("Prefills/Decodes")
	}
}

func TestEndpointRoleJSON(t *testing.T) {
	b, err := json.Marshal(Endpoint{Key: "10.0.0.1:80", Role: RolePrefill})
	if err != nil || string(b) != `{"address":"10.0.0.1:80","role":"prefill"}` {
		t.Fatalf("marshal: %s %v", b, err)
	}
	if b, _ := json.Marshal(Endpoint{Key: "10.0.0.1:80"}); strings.Contains(string(b), "role") {
		t.Fatalf("a both endpoint's record changed: %s", b)
	}
	set := EndpointSet{Endpoints: []Endpoint{{Key: "10.0.0.1:80", Role: 7}}}
	if err := set.Validate(); !errors.Is(err, ErrInvalidEndpointSet) {
		t.Fatalf("role 7 accepted: %v", err)
	}
}
