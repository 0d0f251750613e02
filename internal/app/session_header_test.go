package app

import (
	"slices"
	"strings"
	"testing"
)

// router.session_header takes one name or a list, defaults to x-prefix-id,
// is validated (config check reports the line), and --session-header
// overrides it.
func TestSessionHeaderConfig(t *testing.T) {
	if d := DefaultFileConfig(); !slices.Equal(d.Router.SessionHeader, []string{"x-prefix-id"}) {
		t.Fatalf("default %v", d.Router.SessionHeader)
	}
	for yaml, want := range map[string][]string{
		"router:\n  session_header: x-session-id\n":              {"x-session-id"},
		"router:\n  session_header: [x-session-id, x-user-id]\n": {"x-session-id", "x-user-id"},
	} {
		c, err := ParseConfig([]byte(yaml))
		if err != nil || !slices.Equal(c.Router.SessionHeader, want) {
			t.Errorf("%q: %v %v, want %v", yaml, c.Router.SessionHeader, err, want)
		}
	}
	for _, yaml := range []string{
		"router:\n  session_header: \"bad name\"\n",
		"router:\n  session_header: []\n",
		"router:\n  session_header: [a, b, c, d, e, f, g, h, i]\n",
		"router:\n  session_header: [x-a, x-a]\n",
		"router:\n  session_header: 5\n",
	} {
		if _, err := ParseConfig([]byte(yaml)); err == nil || !strings.Contains(err.Error(), "router.session_header") {
			t.Errorf("%q: error %v does not name router.session_header", yaml, err)
		}
	}
	c := DefaultFileConfig()
	o := ServeOptions{set: map[string]string{"session-header": "x-session-id, x-prefix-id"}}
	if err := o.applyFlags(&c); err != nil || !slices.Equal(c.Router.SessionHeader, []string{"x-session-id", "x-prefix-id"}) {
		t.Fatalf("flag: %v %v", err, c.Router.SessionHeader)
	}
	o = ServeOptions{set: map[string]string{"session-header": "x a"}}
	if err := o.applyFlags(&c); err == nil {
		t.Fatal("--session-header 'x a' accepted")
	}
}
