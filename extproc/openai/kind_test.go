package openai

import (
	"errors"
	"path"
	"strings"
	"testing"
)

func TestCleanPath(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, want string // want "" = ErrInvalidPath
	}{
		{"/v1/chat/completions", "/v1/chat/completions"},
		{"/", "/"},
		{"/v1/", "/v1/"},
		{"/v1/models/", "/v1/models/"},
		{"/v1/../../etc/passwd", "/etc/passwd"},
		{"/v1/./../x", "/x"},
		{"//v1/..", "/"},
		{"/v1/chat/completions/../../metrics", "/v1/metrics"},
		{"/v1/chat/completions/../models", "/v1/chat/models"},
		{"/v1/chat/completions/../../models", "/v1/models"},
		{"/v1//models", "/v1/models"},
		{"/v1/models/.", "/v1/models/"},
		{"/v1/models/..", "/v1/"},
		{"/..", "/"},
		{"/v1/chat/%63ompletions", "/v1/chat/completions"},
		{"/v1/files/a%2etxt", "/v1/files/a.txt"},
		{"/v1/files/a%20b", "/v1/files/a b"},
		{"/v1/files/%C3%A9", "/v1/files/\u00e9"},
		{"/v1/...", "/v1/..."},
		{"/v1/.hidden", "/v1/.hidden"},
		// Refused.
		{"", ""},
		{"v1/models", ""},
		{"*", ""},
		{"/v1/%2e%2e/metrics", ""},
		{"/v1/%2E%2E/metrics", ""},
		{"/v1/.%2e/metrics", ""},
		{"/v1/%2e/metrics", ""},
		{"/v1/..%2fmetrics", ""},
		{"/v1/..%2Fmetrics", ""},
		{"/v1/..%5cmetrics", ""},
		{"/v1/..%5Cmetrics", ""},
		{"/v1/..\\metrics", ""},
		{"/v1/%252e%252e/metrics", ""},
		{"/v1/%25", ""},
		{"/v1/%", ""},
		{"/v1/%2", ""},
		{"/v1/%zz", ""},
		{"/v1/%00", ""},
		{"/v1/a\x00b", ""},
		{"/v1/%0a", ""},
		{"/v1/a\x7f", ""},
	}
	for _, tt := range tests {
		got, err := CleanPath(tt.in)
		switch {
		case tt.want == "" && (err == nil || !errors.Is(err, ErrInvalidPath)):
			t.Errorf("CleanPath(%q) = %q, %v; want ErrInvalidPath", tt.in, got, err)
		case tt.want != "" && (err != nil || got != tt.want):
			t.Errorf("CleanPath(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

func TestCleanPathErrorIsBounded(t *testing.T) {
	t.Parallel()
	_, err := CleanPath("/%2f" + strings.Repeat("a", 1<<20))
	if err == nil || len(err.Error()) > 1024 {
		t.Fatalf("error of %d bytes", len(err.Error()))
	}
}

func TestCleanPathCleanInputDoesNotAllocate(t *testing.T) {
	p := "/v1/chat/completions"
	if n := testing.AllocsPerRun(100, func() { _, _ = CleanPath(p) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

// FuzzCleanPath: CleanPath never panics, fails only with ErrInvalidPath, and
// returns an absolute path that is already clean (cleaning it again changes
// nothing) with no backslash, control character or dot segment.
func FuzzCleanPath(f *testing.F) {
	f.Fuzz(func(t *testing.T, in string) {
		out, err := CleanPath(in)
		if err != nil {
			if !errors.Is(err, ErrInvalidPath) || out != "" {
				t.Fatalf("CleanPath(%q) = %q, %v", in, out, err)
			}
			return
		}
		if !strings.HasPrefix(out, "/") || strings.ContainsAny(out, "\\\x00") || strings.Contains(out, "//") {
			t.Fatalf("CleanPath(%q) = %q", in, out)
		}
		trimmed := strings.TrimSuffix(out, "/")
		if out != "/" && path.Clean(trimmed) != trimmed {
			t.Fatalf("CleanPath(%q) = %q is not clean", in, out)
		}
		for seg := range strings.SplitSeq(trimmed, "/") {
			if seg == "." || seg == ".." {
				t.Fatalf("CleanPath(%q) = %q has a dot segment", in, out)
			}
		}
		if again, err := CleanPath(out); err != nil || again != out {
			t.Fatalf("CleanPath(CleanPath(%q)) = %q, %v; want %q", in, again, err, out)
		}
	})
}
