package hints

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

func headers(kv ...string) Getter {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(name string) (string, bool) {
		v, ok := m[name]
		return v, ok
	}
}

// def is the result for a request without hints.
var def = routing.Hints{OSL: routing.LevelMedium, IAT: routing.LevelMedium}

// with returns def changed by f.
func with(f func(h *routing.Hints)) routing.Hints {
	h := def
	f(&h)
	return h
}

func TestParse(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 129) // 258 bytes
	sum := sha256.Sum256([]byte(long))
	rehashed := sha256.Sum256([]byte("sha256:" + hex.EncodeToString(sum[:])))
	tests := []struct {
		name         string
		h            Getter
		nvext        string
		want         routing.Hints
		wantProblems []string
		wantCount    int
	}{
		{name: "nothing", want: def},
		{name: "nil getter with nvext", nvext: `{"annotations":["osl:LOW"]}`, want: with(func(h *routing.Hints) { h.OSL = routing.LevelLow })},
		{
			name: "all headers",
			h:    headers(HeaderPrefixID, "  sess-1 ", HeaderTotalRequests, "12", HeaderOSL, "low", HeaderIAT, "HIGH", HeaderPriority, "-5"),
			want: routing.Hints{PrefixID: "sess-1", TotalRequests: 12, OSL: routing.LevelLow, IAT: routing.LevelHigh, Priority: -5, HasPriority: true},
		},
		{
			name:  "all agent hints",
			nvext: `{"agent_hints":{"prefix_id":"agent-7","total_requests":40,"osl":2000,"iat":50.5,"priority":3,"latency_sensitivity":2.5}}`,
			want:  routing.Hints{PrefixID: "agent-7", TotalRequests: 40, OSL: routing.LevelHigh, OSLTokens: 2000, IAT: routing.LevelLow, IATMillis: 50, Priority: 3, HasPriority: true, LatencySensitivity: 2.5},
		},
		{
			name:  "all annotations",
			nvext: `{"annotations":["prefix_id:ann:1","total_requests: 3","osl:300","iat:medium","priority:9","request_id:x","noise"]}`,
			want:  routing.Hints{PrefixID: "ann:1", TotalRequests: 3, OSL: routing.LevelMedium, OSLTokens: 300, IAT: routing.LevelMedium},
		},
		{
			name:  "header wins over agent hints and annotations",
			h:     headers(HeaderPrefixID, "hdr", HeaderTotalRequests, "1", HeaderOSL, "HIGH", HeaderIAT, "10", HeaderPriority, "7"),
			nvext: `{"annotations":["prefix_id:ann","total_requests:2","osl:LOW","iat:HIGH"],"agent_hints":{"prefix_id":"agent","total_requests":3,"osl":1,"iat":1000,"priority":-7}}`,
			want:  routing.Hints{PrefixID: "hdr", TotalRequests: 1, OSL: routing.LevelHigh, IAT: routing.LevelLow, IATMillis: 10, Priority: 7, HasPriority: true},
		},
		{
			name:  "agent hints win over annotations",
			nvext: `{"annotations":["prefix_id:ann","total_requests:2","osl:LOW","iat:HIGH"],"agent_hints":{"prefix_id":"agent","total_requests":3,"osl":"medium","iat":99}}`,
			want:  routing.Hints{PrefixID: "agent", TotalRequests: 3, OSL: routing.LevelMedium, IAT: routing.LevelLow, IATMillis: 99},
		},
		{
			name:  "first annotation of a key wins",
			nvext: `{"annotations":["osl:LOW","osl:HIGH","prefix_id: a ","prefix_id:b"]}`,
			want:  with(func(h *routing.Hints) { h.OSL, h.PrefixID = routing.LevelLow, "a" }),
		},
		{
			name:  "invalid header falls back to the body",
			h:     headers(HeaderOSL, "huge", HeaderTotalRequests, "-3", HeaderPrefixID, "bad\x01id"),
			nvext: `{"agent_hints":{"osl":10,"total_requests":5},"annotations":["prefix_id:ok"]}`,
			want: with(func(h *routing.Hints) {
				h.OSL, h.OSLTokens, h.TotalRequests, h.PrefixID = routing.LevelLow, 10, 5, "ok"
			}),
			wantProblems: []string{HeaderPrefixID, HeaderTotalRequests, HeaderOSL},
			wantCount:    3,
		},
		{
			name:         "garbage everywhere gives defaults and problems",
			h:            headers(HeaderOSL, "NaN", HeaderIAT, "Inf", HeaderTotalRequests, "abc", HeaderPriority, "high"),
			nvext:        `{"agent_hints":{"osl":-1,"iat":"0x10","total_requests":2.5,"priority":[1],"latency_sensitivity":-0.5,"prefix_id":42},"annotations":["osl:1_000","iat:","total_requests:-0.5"]}`,
			want:         def,
			wantProblems: []string{"nvext.agent_hints.prefix_id", HeaderTotalRequests, "nvext.agent_hints.total_requests", "nvext.annotations:total_requests"},
			wantCount:    12,
		},
		{
			name:  "empty and blank values are absent, not problems",
			h:     headers(HeaderPrefixID, "", HeaderOSL, "   ", HeaderPriority, ""),
			nvext: `{"agent_hints":{"prefix_id":"  ","osl":null},"annotations":["osl:"]}`,
			want:  def,
		},
		{
			name:  "huge numbers are clamped",
			h:     headers(HeaderTotalRequests, "99999999999999999999999", HeaderOSL, "1e400", HeaderIAT, "3e9", HeaderPriority, "-1e300"),
			nvext: `{"agent_hints":{"latency_sensitivity":1e9}}`,
			want: routing.Hints{TotalRequests: MaxTotalRequests, OSL: routing.LevelHigh, OSLTokens: 1<<31 - 1, IAT: routing.LevelHigh, IATMillis: 1<<31 - 1,
				Priority: -MaxPriority, HasPriority: true, LatencySensitivity: MaxLatencySensitivity},
		},
		{
			name: "integral number forms",
			h:    headers(HeaderTotalRequests, "1.2e1", HeaderPriority, "+4.0"),
			want: with(func(h *routing.Hints) { h.TotalRequests, h.Priority, h.HasPriority = 12, 4, true }),
		},
		{
			name:         "fractional integers are invalid",
			h:            headers(HeaderPriority, "2.5", HeaderTotalRequests, "0.1"),
			want:         def,
			wantProblems: []string{HeaderTotalRequests, HeaderPriority},
			wantCount:    2,
		},
		{
			name:         "too long number",
			h:            headers(HeaderTotalRequests, strings.Repeat("1", 65)),
			want:         def,
			wantProblems: []string{HeaderTotalRequests},
			wantCount:    1,
		},
		{
			name:  "agent hints as strings",
			nvext: `{"agent_hints":{"total_requests":"7","osl":"HIGH","priority":"-2","latency_sensitivity":"0.25"}}`,
			want: with(func(h *routing.Hints) {
				h.TotalRequests, h.OSL, h.Priority, h.HasPriority, h.LatencySensitivity = 7, routing.LevelHigh, -2, true, 0.25
			}),
		},
		{
			name:  "priority and latency sensitivity together",
			nvext: `{"agent_hints":{"priority":0,"latency_sensitivity":3}}`,
			want:  with(func(h *routing.Hints) { h.HasPriority, h.LatencySensitivity = true, 3 }),
		},
		{
			name: "unicode prefix id kept",
			h:    headers(HeaderPrefixID, "セッション-1 ✓"),
			want: with(func(h *routing.Hints) { h.PrefixID = "セッション-1 ✓" }),
		},
		{
			name: "prefix id of exactly the limit kept",
			h:    headers(HeaderPrefixID, strings.Repeat("a", MaxPrefixIDLen)),
			want: with(func(h *routing.Hints) { h.PrefixID = strings.Repeat("a", MaxPrefixIDLen) }),
		},
		{
			name: "long prefix id hashed",
			h:    headers(HeaderPrefixID, long),
			want: with(func(h *routing.Hints) { h.PrefixID = "sha256:" + hex.EncodeToString(sum[:]) }),
		},
		{
			// A short id shaped like a hash is hashed too, so it cannot
			// stand for another (long) id.
			name: "prefix id shaped like a hash hashed",
			h:    headers(HeaderPrefixID, "sha256:"+hex.EncodeToString(sum[:])),
			want: with(func(h *routing.Hints) { h.PrefixID = "sha256:" + hex.EncodeToString(rehashed[:]) }),
		},
		{
			name:         "prefix id with invalid UTF-8 or controls ignored",
			h:            headers(HeaderPrefixID, "a\xffb"),
			nvext:        `{"agent_hints":{"prefix_id":"tab\there"},"annotations":["prefix_id:nl\nx"]}`,
			want:         def,
			wantProblems: []string{HeaderPrefixID, "nvext.agent_hints.prefix_id", "nvext.annotations:prefix_id"},
			wantCount:    3,
		},
		{
			name:         "nvext problems from openai are reported",
			nvext:        `{"annotations":"x","agent_hints":[],"cache_salt":1}`,
			want:         def,
			wantProblems: []string{"nvext.annotations", "nvext.agent_hints", "nvext.cache_salt"},
			wantCount:    3,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, problems := Parse(tt.h, openai.ParseNVExt([]byte(tt.nvext)))
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("hints mismatch (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantProblems, problems.Fields(), cmpEmpty); diff != "" {
				t.Errorf("problem fields (-want +got):\n%s", diff)
			}
			if problems.Count != tt.wantCount {
				t.Errorf("problems.Count = %d, want %d (%s)", problems.Count, tt.wantCount, problems)
			}
		})
	}
}

var cmpEmpty = cmp.Comparer(func(a, b []string) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return cmp.Equal([]string(a), []string(b))
})

func TestLevels(t *testing.T) {
	t.Parallel()
	tests := []struct {
		osl, iat   string
		wantOSL    routing.Level
		wantTokens int
		wantIAT    routing.Level
		wantMillis int
	}{
		{"0", "0", routing.LevelLow, 0, routing.LevelLow, 0},
		{"255", "99", routing.LevelLow, 255, routing.LevelLow, 99},
		{"255.9", "99.9", routing.LevelLow, 255, routing.LevelLow, 99},
		{"256", "100", routing.LevelMedium, 256, routing.LevelMedium, 100},
		{"1023", "499", routing.LevelMedium, 1023, routing.LevelMedium, 499},
		{"1024", "500", routing.LevelHigh, 1024, routing.LevelHigh, 500},
		{"1e6", "6e4", routing.LevelHigh, 1000000, routing.LevelHigh, 60000},
		{"Low", "lOw", routing.LevelLow, 0, routing.LevelLow, 0},
		{"MEDIUM", "medium", routing.LevelMedium, 0, routing.LevelMedium, 0},
		{" high ", "HIGH", routing.LevelHigh, 0, routing.LevelHigh, 0},
		{"med", "-1", routing.LevelMedium, 0, routing.LevelMedium, 0}, // unknown: MEDIUM + problem
	}
	for _, tt := range tests {
		got, _ := Parse(headers(HeaderOSL, tt.osl, HeaderIAT, tt.iat), openai.NVExt{})
		if got.OSL != tt.wantOSL || got.OSLTokens != tt.wantTokens || got.IAT != tt.wantIAT || got.IATMillis != tt.wantMillis {
			t.Errorf("osl %q iat %q: got %v/%d %v/%d, want %v/%d %v/%d", tt.osl, tt.iat,
				got.OSL, got.OSLTokens, got.IAT, got.IATMillis, tt.wantOSL, tt.wantTokens, tt.wantIAT, tt.wantMillis)
		}
	}
}

func TestProblems(t *testing.T) {
	t.Parallel()
	var p Problems
	if p.String() != "" || len(p.Fields()) != 0 {
		t.Fatalf("zero Problems: %q %v", p.String(), p.Fields())
	}
	for _, f := range []string{"a", "b", "a", "c", "d", "e"} {
		p.add(f)
	}
	if p.Count != 6 {
		t.Errorf("Count = %d, want 6", p.Count)
	}
	if diff := cmp.Diff([]string{"a", "b", "c", "d"}, p.Fields()); diff != "" {
		t.Errorf("Fields (-want +got):\n%s", diff)
	}
	if want := "6 ignored hint values: a, b, c, d, ..."; p.String() != want {
		t.Errorf("String = %q, want %q", p.String(), want)
	}
	// Fields returns a copy.
	p.Fields()[0] = "z"
	if p.Fields()[0] != "a" {
		t.Error("Fields aliases the Problems")
	}
}

func TestParseDoesNotAllocateWithoutHints(t *testing.T) {
	h := headers()
	nv := openai.NVExt{}
	if n := testing.AllocsPerRun(100, func() { Parse(h, nv) }); n > 0 {
		t.Errorf("Parse without hints: %v allocs", n)
	}
}
