package openai

import (
	"strings"
	"testing"
)

func TestKindOfBody(t *testing.T) {
	deep := `{"prompt":"x","a":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `}`
	for _, tc := range []struct {
		body string
		want Kind
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, KindChat},
		{`{"model":"m","prompt":"hi"}`, KindCompletion},
		{`{"model":"m","nested":{"messages":[]},"prompt":"hi"}`, KindCompletion},
		{`not json`, KindCompletion},
		{``, KindCompletion},
		{deep, KindCompletion},
	} {
		if got := KindOfBody([]byte(tc.body)); got != tc.want {
			t.Errorf("KindOfBody(%.40q) = %v, want %v", tc.body, got, tc.want)
		}
	}
	if KindChat.Path() != "/v1/chat/completions" || KindCompletion.Path() != "/v1/completions" || KindOther.Path() != "" {
		t.Error("Kind.Path")
	}
}

// FuzzKindOfBody: any body, however nested or broken, is classified as a
// chat or a completion request, never anything else, without a panic.
func FuzzKindOfBody(f *testing.F) {
	for _, s := range []string{`{"messages":[]}`, `{"prompt":"x"}`, `{"a":{"messages":1}}`, `[`, ``, `{"messages"`,
		strings.Repeat(`{"a":`, 100_000) + `1` + strings.Repeat(`}`, 100_000)} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if k := KindOfBody(body); k != KindChat && k != KindCompletion {
			t.Fatalf("KindOfBody(%.64q) = %v", body, k)
		}
	})
}
