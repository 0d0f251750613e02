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
