package hints

import (
	"errors"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/extproc/openai"
)

func TestObjective(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	cases := []struct {
		name   string
		header map[string]string
		nvext  string
		want   time.Duration
		bad    string // the field named in the error
	}{
		{name: "none"},
		{name: "header", header: map[string]string{HeaderSLOTTFT: "300"}, want: 300 * ms},
		{name: "header spaces and fraction", header: map[string]string{HeaderSLOTTFT: " 2.5 "}, want: 2500 * time.Microsecond},
		{name: "llm-d header", header: map[string]string{HeaderLLMDSLOTTFT: "1e3"}, want: time.Second},
		{name: "first header wins", header: map[string]string{HeaderSLOTTFT: "100", HeaderLLMDSLOTTFT: "200"}, want: 100 * ms},
		{name: "agent hints number", nvext: `{"agent_hints":{"ttft_slo_ms":450}}`, want: 450 * ms},
		{name: "agent hints string", nvext: `{"agent_hints":{"ttft_slo_ms":"450"}}`, want: 450 * ms},
		{name: "agent hints null", nvext: `{"agent_hints":{"ttft_slo_ms":null}}`},
		{name: "header over body", header: map[string]string{HeaderSLOTTFT: "120"}, nvext: `{"agent_hints":{"ttft_slo_ms":450}}`, want: 120 * ms},
		{name: "upper bound", header: map[string]string{HeaderSLOTTFT: "600000"}, want: 10 * time.Minute},
		{name: "latency_sensitivity is no objective", nvext: `{"agent_hints":{"latency_sensitivity":2}}`},
		{name: "zero", header: map[string]string{HeaderSLOTTFT: "0"}, bad: HeaderSLOTTFT},
		{name: "below 1 ms", header: map[string]string{HeaderSLOTTFT: "0.5"}, bad: HeaderSLOTTFT},
		{name: "negative", header: map[string]string{HeaderSLOTTFT: "-5"}, bad: HeaderSLOTTFT},
		{name: "too large", header: map[string]string{HeaderSLOTTFT: "600001"}, bad: HeaderSLOTTFT},
		{name: "huge", header: map[string]string{HeaderSLOTTFT: "1e400"}, bad: HeaderSLOTTFT},
		{name: "text", header: map[string]string{HeaderSLOTTFT: "fast"}, bad: HeaderSLOTTFT},
		{name: "units", header: map[string]string{HeaderSLOTTFT: "300ms"}, bad: HeaderSLOTTFT},
		{name: "hex", header: map[string]string{HeaderSLOTTFT: "0x10"}, bad: HeaderSLOTTFT},
		{name: "bad header not skipped", header: map[string]string{HeaderSLOTTFT: "x"}, nvext: `{"agent_hints":{"ttft_slo_ms":450}}`, bad: HeaderSLOTTFT},
		{name: "bad llm-d header", header: map[string]string{HeaderLLMDSLOTTFT: "NaN"}, bad: HeaderLLMDSLOTTFT},
		{name: "agent hints object", nvext: `{"agent_hints":{"ttft_slo_ms":{}}}`, bad: "nvext.agent_hints.ttft_slo_ms"},
		{name: "agent hints negative", nvext: `{"agent_hints":{"ttft_slo_ms":-1}}`, bad: "nvext.agent_hints.ttft_slo_ms"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			get := func(name string) (string, bool) { v, ok := c.header[name]; return v, ok }
			var nv openai.NVExt
			if c.nvext != "" {
				nv = openai.ParseNVExt([]byte(c.nvext))
			}
			got, err := Objective(get, nv)
			if c.bad != "" {
				var fe *openai.FieldError
				if !errors.As(err, &fe) || !errors.Is(err, openai.ErrInvalidField) || fe.Field != c.bad {
					t.Fatalf("err = %v, want a FieldError on %s", err, c.bad)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("Objective = %v, %v; want %v", got, err, c.want)
			}
		})
	}
}

// FuzzObjective checks that any header value or nvext gives either an
// objective within bounds or an invalid-field error, never a panic.
func FuzzObjective(f *testing.F) {
	for _, s := range []string{"300", "0", "-1", "1e400", "600000", "600000.0001", "0.999", " 12 ", "NaN", "x"} {
		f.Add(s, []byte(`{"agent_hints":{"ttft_slo_ms":250}}`))
	}
	f.Add("", []byte(`{"agent_hints":{"ttft_slo_ms":"1e-9"}}`))
	f.Add("", []byte(`{"agent_hints":{"ttft_slo_ms":[1]}}`))
	f.Fuzz(func(t *testing.T, header string, nvext []byte) {
		get := func(name string) (string, bool) { return header, name == HeaderSLOTTFT && header != "" }
		got, err := Objective(get, openai.ParseNVExt(nvext))
		switch {
		case err != nil:
			if !errors.Is(err, openai.ErrInvalidField) || got != 0 {
				t.Fatalf("Objective = %v, %v", got, err)
			}
		case got != 0 && (got < MinObjective || got > MaxObjective):
			t.Fatalf("objective %v out of bounds", got)
		}
	})
}
