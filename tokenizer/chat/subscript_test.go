package chat

import (
	"strings"
	"testing"

	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
)

func TestRewriteSubscripts(t *testing.T) {
	const g = getitemName
	for _, c := range []struct{ src, want string }{
		// Rewritten: any index but a string literal.
		{"{{ x[-1] }}", "{{ " + g + "(x, -1) }}"},
		{"{{ x[0] }}", "{{ " + g + "(x, 0) }}"},
		{"{{ x[i - 1].role }}", "{{ " + g + "(x, i - 1).role }}"},
		{"{{ a.b.c[-1].d }}", "{{ " + g + "(a.b.c, -1).d }}"},
		{"{{ a[-1][-2] }}", "{{ " + g + "(" + g + "(a, -1), -2) }}"},
		{"{{ a[b[-1]] }}", "{{ " + g + "(a, " + g + "(b, -1)) }}"},
		{"{{ f(x)[-1] }}", "{{ " + g + "(f(x), -1) }}"},
		{"{{ m['content'][-1] }}", "{{ " + g + "(m['content'], -1) }}"},
		{"{{ (a + b)[-1] }}", "{{ " + g + "((a + b), -1) }}"},
		{"{{ [1, 2][-1] }}", "{{ " + g + "([1, 2], -1) }}"},
		{"{{ 'ab'[-1] }}", "{{ " + g + "('ab', -1) }}"},
		{"{{ {'a': [1]}['a'][-1] }}", "{{ " + g + "({'a': [1]}['a'], -1) }}"},
		{"{{ -x[0] }}", "{{ -" + g + "(x, 0) }}"},
		{"{{ not x[0] }}", "{{ not " + g + "(x, 0) }}"},
		{"{% set y = x[-1] if x else z[0] %}", "{% set y = " + g + "(x, -1) if x else " + g + "(z, 0) %}"},
		{"{% for m in messages[1] %}{% endfor %}", "{% for m in " + g + "(messages, 1) %}{% endfor %}"},
		{"{{ a.split(',')[0].b[-1] }}", "{{ " + g + "(a.split(',')[0].b, -1) }}"},
		{"{%- if x[-1] -%}\r\n{%- endif %}", "{%- if " + g + "(x, -1) -%}\n{%- endif %}"},
		// Left alone: string keys, slices, tuples, list literals, a
		// subscript right after .split(...), filters and tests, text
		// outside tags, comments, raw blocks.
		{"{{ m['role'] }}", "{{ m['role'] }}"},
		{"{{ x[1:] }}{{ x[::-1] }}{{ x[:-1] }}", "{{ x[1:] }}{{ x[::-1] }}{{ x[:-1] }}"},
		{"{{ x[1, 2] }}", "{{ x[1, 2] }}"},
		{"{{ [1][0:1] }}{% set a = [1] %}{% if [1] %}{% endif %}{{ 1 in [1] }}", "{{ [1][0:1] }}{% set a = [1] %}{% if [1] %}{% endif %}{{ 1 in [1] }}"},
		{"{{ c.split('</think>')[-1].lstrip('\\n') }}", "{{ c.split('</think>')[-1].lstrip('\\n') }}"},
		{"{{ x|first[0] }}{{ x is f[0] }}", "{{ x|first[0] }}{{ x is f[0] }}"},
		{"a[-1] {# x[-1] #}{% raw %}{{ x[-1] }}{% endraw %}", "a[-1] {# x[-1] #}{% raw %}{{ x[-1] }}{% endraw %}"},
		{"{{ 'a' 'b'[0] }}", "{{ 'a' 'b'[0] }}"},
		{"{{ x[-1 }}", "{{ x[-1 }}"}, // the lexer fails: unchanged
		{"no tags [-1]\n", "no tags [-1]\n"},
	} {
		if got := rewriteSubscripts(c.src, compileConfig()); got != c.want {
			t.Errorf("rewriteSubscripts(%q)\n got %q\nwant %q", c.src, got, c.want)
		}
	}
}

func TestGetItem(t *testing.T) {
	for _, c := range []struct {
		src, want string
	}{
		{"{{ x[-3] }}{{ x[-4] is defined }}{{ x[2] }}{{ x[3] is defined }}", "aFalsecFalse"},
		{"{{ s[0] }}{{ s[-1] }}{{ s[-2] }}{{ s[3] is defined }}{{ s[-4] is defined }}", "é😀€FalseFalse"},
		{"{{ d['k'] }}{{ d[k] }}{{ d.k }}{{ d['missing'] is defined }}", "vvvFalse"},
		{"{{ n[1] }}", ""},
	} {
		tmpl, err := Compile(c.src)
		if err != nil {
			t.Fatal(err)
		}
		d := exec.NewDict()
		set(d, "k", "v")
		out, err := tmpl.Render(t.Context(), Input{Extra: map[string]any{
			"x": []any{"a", "b", "c"}, "s": "é€😀", "d": d, "k": "k", "n": nil,
		}})
		if c.src == "{{ n[1] }}" {
			// Subscripting none is an error in Jinja and in gonja.
			if err == nil {
				t.Errorf("%s: rendered %q, want an error", c.src, out)
			}
			continue
		}
		if err != nil || out != c.want {
			t.Errorf("%s: got %q, %v; want %q", c.src, out, err, c.want)
		}
	}
}

func compileConfig() *config.Config {
	cfg := config.New()
	cfg.TrimBlocks = true
	return cfg
}

// FuzzRewriteSubscripts: a template gonja parses still parses after the
// rewrite, and the rewrite is idempotent (its output has nothing left to
// rewrite). A failure means the rewriter misplaced a call.
func FuzzRewriteSubscripts(f *testing.F) {
	for _, s := range []string{
		"{{ x[-1] }}", "{{ a.b(c)[d[-1]][0].e(f[1:])[-1] }}", "{% set y = [x[0], {'k': z[-1]}][-1] %}",
		"{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}",
		"{% for m in messages[::-1] %}{{ messages[loop.index0 - 1].role }}{% endfor %}",
		"{{ (x|list)[-1] }}{{ x|join(',') }}{{ -x[0] ** 2 }}", "{% macro f(a=x[-1]) %}{{ a[0] }}{% endmacro %}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, src string) {
		if len(src) > 4096 {
			return
		}
		cfg := compileConfig()
		once := rewriteSubscripts(src, cfg)
		if twice := rewriteSubscripts(once, cfg); twice != once {
			t.Fatalf("not idempotent:\n src %q\nonce %q\n2nd  %q", src, once, twice)
		}
		if once == strings.ReplaceAll(strings.ReplaceAll(src, "\r\n", "\n"), "\r", "\n") || !parses(src, cfg) {
			return
		}
		if !parses(once, cfg) {
			t.Fatalf("gonja parses %q but not its rewrite %q", src, once)
		}
	})
}

func parses(src string, cfg *config.Config) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	loader, err := loaders.NewMemoryLoader(map[string]string{"/t": src})
	if err != nil {
		return false
	}
	_, err = exec.NewTemplate("/t", cfg, loader, newEnvironment())
	return err == nil
}
