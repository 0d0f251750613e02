package hints

import (
	"math"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// FuzzHints checks that any header values and nvext JSON give hints within
// their documented ranges, deterministically, and that a valid header always
// wins over the body. Seeds: testdata/fuzz/FuzzHints.
func FuzzHints(f *testing.F) {
	f.Fuzz(func(t *testing.T, prefixID, total, osl, iat, prio string, nvext []byte) {
		vals := map[string]string{
			HeaderPrefixID: prefixID, HeaderTotalRequests: total, HeaderOSL: osl, HeaderIAT: iat, HeaderPriority: prio,
		}
		get := func(name string) (string, bool) {
			v, ok := vals[name]
			return v, ok && v != ""
		}
		nv := openai.ParseNVExt(nvext)
		got, problems := Parse(get, nv)
		checkRanges(t, got)
		if len(problems.Fields()) > MaxProblemFields || problems.Count < len(problems.Fields()) {
			t.Fatalf("problems %+v", problems)
		}
		again, problems2 := Parse(get, nv)
		if diff := cmp.Diff(got, again); diff != "" || problems != problems2 {
			t.Fatalf("not deterministic:\n%s", diff)
		}
		checkResolve(t, got)
		// A header that is valid on its own wins over the body.
		for name, v := range vals {
			if strings.TrimSpace(v) == "" {
				continue
			}
			alone, p := Parse(headers(name, v), openai.NVExt{})
			if p.Count > 0 {
				continue
			}
			switch name {
			case HeaderPrefixID:
				if got.PrefixID != alone.PrefixID {
					t.Fatalf("prefix id %q, header alone gives %q", got.PrefixID, alone.PrefixID)
				}
			case HeaderTotalRequests:
				if got.TotalRequests != alone.TotalRequests {
					t.Fatalf("total requests %d, header alone gives %d", got.TotalRequests, alone.TotalRequests)
				}
			case HeaderOSL:
				if got.OSL != alone.OSL || got.OSLTokens != alone.OSLTokens {
					t.Fatalf("osl %v/%d, header alone gives %v/%d", got.OSL, got.OSLTokens, alone.OSL, alone.OSLTokens)
				}
			case HeaderIAT:
				if got.IAT != alone.IAT || got.IATMillis != alone.IATMillis {
					t.Fatalf("iat %v/%d, header alone gives %v/%d", got.IAT, got.IATMillis, alone.IAT, alone.IATMillis)
				}
			case HeaderPriority:
				if got.Priority != alone.Priority || !got.HasPriority {
					t.Fatalf("priority %d/%v, header alone gives %d", got.Priority, got.HasPriority, alone.Priority)
				}
			}
		}
	})
}

// checkResolve: whatever the client sent, the client-priority policy
// holds: cap never exceeds the objective's priority (or the ceiling
// without one) and keeps a lower value, ignore gives the objective's,
// allow keeps the client's.
func checkResolve(t *testing.T, client routing.Hints) {
	t.Helper()
	gold := prios{"gold": 10}
	withObj := headers(HeaderInferenceObjective, "gold")
	resolve := func(g Getter, pol PriorityPolicy) routing.Hints {
		h := client
		ResolvePriority(g, gold, pol, &h)
		checkRanges(t, h)
		return h
	}
	if h := resolve(withObj, PriorityPolicy{}); !h.HasPriority || h.Priority > 10 || (client.HasPriority && client.Priority <= 10 && h.Priority != client.Priority) {
		t.Fatalf("cap: client %d/%v gave %d/%v", client.Priority, client.HasPriority, h.Priority, h.HasPriority)
	}
	if h := resolve(nil, PriorityPolicy{Max: 3, HasMax: true}); h.Priority > 3 || (!h.HasPriority && h.LatencySensitivity > 3) || h.HeadStart() > 3*time.Second {
		t.Fatalf("cap 3: client %+v gave %+v", client, h)
	}
	if h := resolve(withObj, PriorityPolicy{Mode: ClientPriorityIgnore}); h.Priority != 10 || !h.HasPriority {
		t.Fatalf("ignore: gave %d/%v", h.Priority, h.HasPriority)
	}
	if h := resolve(nil, PriorityPolicy{Mode: ClientPriorityIgnore}); h.HasPriority || h.HeadStart() != 0 {
		t.Fatalf("ignore without objective: gave %+v", h)
	}
	if h := resolve(withObj, PriorityPolicy{Mode: ClientPriorityAllow}); client.HasPriority && h.Priority != client.Priority {
		t.Fatalf("allow: client %d gave %d", client.Priority, h.Priority)
	}
}

func checkRanges(t *testing.T, h routing.Hints) {
	t.Helper()
	for _, l := range []routing.Level{h.OSL, h.IAT} {
		if l != routing.LevelLow && l != routing.LevelMedium && l != routing.LevelHigh {
			t.Fatalf("level %v out of range in %+v", l, h)
		}
	}
	if h.TotalRequests < 0 || h.TotalRequests > MaxTotalRequests {
		t.Fatalf("total requests %d", h.TotalRequests)
	}
	if h.Priority < -MaxPriority || h.Priority > MaxPriority || (!h.HasPriority && h.Priority != 0) {
		t.Fatalf("priority %d (has %v)", h.Priority, h.HasPriority)
	}
	if math.IsNaN(h.LatencySensitivity) || h.LatencySensitivity < 0 || h.LatencySensitivity > MaxLatencySensitivity {
		t.Fatalf("latency sensitivity %v", h.LatencySensitivity)
	}
	if h.OSLTokens < 0 || h.IATMillis < 0 {
		t.Fatalf("raw values %d %d", h.OSLTokens, h.IATMillis)
	}
	if h.OSLTokens > 0 && h.OSL != levelOf(h.OSLTokens, oslLowBelow, oslMediumBelow) {
		t.Fatalf("osl %v for %d tokens", h.OSL, h.OSLTokens)
	}
	if h.IATMillis > 0 && h.IAT != levelOf(h.IATMillis, iatLowBelow, iatMediumBelow) {
		t.Fatalf("iat %v for %d ms", h.IAT, h.IATMillis)
	}
	id := h.PrefixID
	if len(id) > MaxPrefixIDLen || !utf8.ValidString(id) || strings.TrimSpace(id) != id {
		t.Fatalf("prefix id %q", id)
	}
	for _, r := range id {
		if !unicode.IsPrint(r) {
			t.Fatalf("prefix id %q has %U", id, r)
		}
	}
}

func levelOf(n, lowBelow, mediumBelow int) routing.Level {
	switch {
	case n < lowBelow:
		return routing.LevelLow
	case n < mediumBelow:
		return routing.LevelMedium
	}
	return routing.LevelHigh
}
