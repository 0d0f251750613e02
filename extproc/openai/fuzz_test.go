package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"github.com/tidwall/gjson"
)

// FuzzParse checks that Parse never panics, returns only the documented
// errors, agrees with encoding/json on what is valid JSON and on the model,
// and never aliases the body. Seeds: testdata/fuzz/FuzzParse.
func FuzzParse(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte, k uint8) {
		kind := Kind(k % 3)
		orig := bytes.Clone(body)
		r, err := Parse(kind, body)
		if !bytes.Equal(body, orig) {
			t.Fatal("Parse modified the body")
		}
		wellFormed := json.Valid(body) && utf8.Valid(body) && !tooDeep(body, MaxDepth) && firstByte(body) == '{'
		if err != nil {
			if r != nil {
				t.Fatalf("Request %+v returned with error %v", r, err)
			}
			if !errors.Is(err, ErrInvalidJSON) && !errors.Is(err, ErrMissingModel) && !errors.Is(err, ErrInvalidField) {
				t.Fatalf("undocumented error %v", err)
			}
			if errors.Is(err, ErrInvalidJSON) && wellFormed {
				t.Fatalf("encoding/json accepts the body, Parse says %v", err)
			}
			return
		}
		if r == nil || r.Kind != kind {
			t.Fatalf("Request %+v for kind %v", r, kind)
		}
		if firstByte(body) == 0 {
			if kind != KindOther {
				t.Fatal("empty body accepted")
			}
			return
		}
		if !wellFormed {
			t.Fatal("Parse accepted a body that encoding/json rejects")
		}
		if kind != KindOther && r.Model == "" {
			t.Fatal("no model and no error")
		}
		if r.MaxTokens < 0 || r.TextLen() < 0 {
			t.Fatalf("negative MaxTokens %d or TextLen %d", r.MaxTokens, r.TextLen())
		}
		checkModel(t, body, r.Model)
		for _, s := range requestStrings(r) {
			if !utf8.ValidString(s) {
				t.Fatalf("invalid UTF-8 in result: %q", s)
			}
		}
		// Overwrite the body: the Request must not change.
		want, _ := Parse(kind, orig)
		for i := range body {
			body[i] = 0xff
		}
		if diff := cmp.Diff(want, r); diff != "" {
			t.Fatalf("Request aliases the body (-want +got):\n%s", diff)
		}
	})
}

// checkModel compares the model with encoding/json's reading of the body
// (exact key, last duplicate wins).
func checkModel(t *testing.T, body []byte, model string) {
	t.Helper()
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		t.Fatalf("encoding/json: %v", err)
	}
	var want string
	if raw, ok := top["model"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &want); err != nil {
			t.Fatalf("model %s accepted: %v", raw, err)
		}
	}
	if model != want && !lossySurrogates(body) {
		t.Fatalf("model %q, encoding/json reads %q", model, want)
	}
}

// lossySurrogates reports whether body has a \uD800-\uDFFF escape: gjson
// and encoding/json replace a malformed surrogate pair differently (both
// with U+FFFD, but gjson may take the next escape with it). Such input is
// garbage either way.
func lossySurrogates(body []byte) bool {
	for i := 0; i+5 < len(body); i++ {
		if body[i] == '\\' && body[i+1] == 'u' && (body[i+2]|0x20) == 'd' && bytes.IndexByte([]byte("89abAB"), body[i+3]) >= 0 {
			return true
		}
	}
	return false
}

func requestStrings(r *Request) []string {
	s := []string{r.Model, r.CacheSalt, r.NVExt.CacheSalt}
	for _, m := range r.Messages {
		s = append(s, m.Role, m.Content, m.Name)
		for _, p := range m.Parts {
			s = append(s, p.Type, p.Text)
		}
	}
	s = append(s, r.Prompts...)
	return append(s, r.NVExt.Annotations...)
}

// FuzzStreamParser checks that a stream gives the same result however it is
// cut into chunks, and that the first-content signal comes on the chunk
// holding the byte that completes the first content event. The cuts input
// gives the chunk lengths (each byte mod 32, 0 = an empty Feed). Seeds:
// testdata/fuzz/FuzzStreamParser.
func FuzzStreamParser(f *testing.F) {
	f.Fuzz(func(t *testing.T, stream, cuts []byte, small bool) {
		maxEvent := 0
		if small {
			maxEvent = 48
		}
		whole, _ := feedAll(maxEvent, stream)
		if whole.FirstContent > 1 || whole.Events < whole.Oversized+whole.Malformed {
			t.Fatalf("inconsistent result %+v", whole)
		}
		// Byte by byte gives the completing offset.
		bytewise := make([][]byte, len(stream))
		for i := range stream {
			bytewise[i] = stream[i : i+1]
		}
		got, at := feedAll(maxEvent, bytewise...)
		if got != whole {
			t.Fatalf("byte by byte: %+v, single Feed: %+v", got, whole)
		}
		var chunks [][]byte
		var starts []int
		pos := 0
		for i := 0; pos < len(stream); i++ {
			n := 1 << 30
			if len(cuts) > 0 {
				n = int(cuts[i%len(cuts)]) % 32
			}
			n = min(n, len(stream)-pos)
			chunks = append(chunks, stream[pos:pos+n])
			starts = append(starts, pos)
			pos += n
			if n == 0 {
				// An empty Feed, then make progress.
				chunks = append(chunks, stream[pos:pos+1])
				starts = append(starts, pos)
				pos++
			}
		}
		got, c := feedAll(maxEvent, chunks...)
		if got != whole {
			t.Fatalf("in %d chunks: %+v, single Feed: %+v", len(chunks), got, whole)
		}
		if at >= 0 && (c < 0 || at < starts[c] || at >= starts[c]+len(chunks[c])) {
			t.Fatalf("first content on chunk %d, but the event completes at byte %d", c, at)
		}
	})
}

// FuzzParseUsage checks that ParseUsage never panics and reports only
// counts of -1 or more.
func FuzzParseUsage(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		u, ok := ParseUsage(body)
		if u.PromptTokens < -1 || u.CompletionTokens < -1 || u.CachedTokens < -1 {
			t.Fatalf("usage %+v", u)
		}
		if ok && !json.Valid(body) {
			t.Fatal("usage from invalid JSON")
		}
		if !ok && u != unreported() {
			t.Fatalf("usage %+v with ok=false", u)
		}
	})
}

// FuzzCheckJSON: the one-pass checkJSON gives the verdict of the three
// checks it replaced (depth, then gjson's validator, then UTF-8), error for
// error, and accepts exactly what encoding/json accepts in valid UTF-8;
// wellFormed agrees with the depth check and gjson's validator.
func FuzzCheckJSON(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, ` {"a":[1,-0.5e+3,"\u00e9\n",true,false,null,{}]} `, `{"a":1,}`, `[1 2]`, `"\x80"`, `01`, `-`, `1.`, `1e`, `{"a" 1}`, `[[[`, `"\ud800"`, "\"a\tb\"", `{"k":"` + strings.Repeat("lorem ipsum ", 9) + `"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var want error
		switch {
		case tooDeep(body, MaxDepth):
			want = fmt.Errorf("%w: nested deeper than %d levels", ErrInvalidJSON, MaxDepth)
		case !gjson.ValidBytes(body):
			want = fmt.Errorf("%w: malformed or truncated", ErrInvalidJSON)
		case !utf8.Valid(body):
			want = ErrInvalidUTF8
		}
		got := checkJSON(body)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("checkJSON(%q) = %v, the three checks say %v", body, got, want)
		}
		if got, want := wellFormed(body), !tooDeep(body, MaxDepth) && gjson.ValidBytes(body); got != want {
			t.Fatalf("wellFormed(%q) = %v, tooDeep and gjson say %v", body, got, want)
		}
		if wellFormed := json.Valid(body) && utf8.Valid(body) && !tooDeep(body, MaxDepth); (got == nil) != wellFormed {
			t.Fatalf("checkJSON(%q) = %v, encoding/json: %v", body, got, wellFormed)
		}
	})
}
