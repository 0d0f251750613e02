package openai

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/tidwall/gjson"
)

// visit is one callback of a walk: the key and every field of the value.
type visit struct {
	key   string
	typ   gjson.Type
	raw   string
	str   string
	num   uint64 // math.Float64bits, so that -0 and NaN compare exactly
	index int
	// alias: Str shares Raw's bytes (owner.keep copies only those).
	alias bool
}

func (v visit) String() string {
	return fmt.Sprintf("{key %q type %v raw %q str %q num %v index %d alias %v}", v.key, v.typ, v.raw, v.str, math.Float64frombits(v.num), v.index, v.alias)
}

// walkVisits records the callbacks of each (walk=true) or gjson's ForEach
// over t, stopping after stop callbacks (stop < 0: never), and the values.
func walkVisits(t gjson.Result, walk bool, stop int) ([]visit, []gjson.Result) {
	var out []visit
	var vals []gjson.Result
	record := func(k string, v gjson.Result) bool {
		out = append(out, visit{k, v.Type, v.Raw, v.Str, math.Float64bits(v.Num), v.Index, aliases(v.Str, v.Raw)})
		vals = append(vals, v)
		return len(out) != stop
	}
	if walk {
		each(t, record)
	} else {
		t.ForEach(func(k, v gjson.Result) bool { return record(k.Str, v) })
	}
	return out, vals
}

// sameWalk checks that each yields what gjson's ForEach yields over t and
// every container inside it, walked in full and stopped after stop%(n+1)
// callbacks.
func sameWalk(t *testing.T, r gjson.Result, stop uint8) {
	t.Helper()
	want, vals := walkVisits(r, false, -1)
	got, _ := walkVisits(r, true, -1)
	if !slices.Equal(got, want) {
		t.Fatalf("walk of %q:\n got %v\nwant %v", r.Raw, got, want)
	}
	n := int(stop) % (len(want) + 1)
	want, _ = walkVisits(r, false, n)
	got, _ = walkVisits(r, true, n)
	if !slices.Equal(got, want) {
		t.Fatalf("walk of %q stopped after %d:\n got %v\nwant %v", r.Raw, n, got, want)
	}
	for _, v := range vals {
		if v.Type == gjson.JSON {
			sameWalk(t, v, stop)
		}
	}
}

// aliases reports whether s is a non-empty string inside within's bytes.
func aliases(s, within string) bool {
	p, lo := uintptr(unsafe.Pointer(unsafe.StringData(s))), uintptr(unsafe.Pointer(unsafe.StringData(within)))
	return s != "" && p >= lo && p < lo+uintptr(len(within))
}

// walkAny walks r and what it holds, at most depth levels down, for input
// that need not be JSON: the walk must only return.
func walkAny(r gjson.Result, depth int) {
	if depth == 0 {
		return
	}
	each(r, func(_ string, v gjson.Result) bool {
		if v.Type == gjson.JSON {
			walkAny(v, depth-1)
		}
		return true
	})
}

// FuzzWalk: on any input that passes wellFormed (checkJSON's syntax check,
// which every caller of each runs first), each yields exactly the sequence
// of keys and Results (Type, Raw, Str, Num, Index) that gjson's ForEach
// yields, at every nesting level, and stops where ForEach stops when the
// callback returns false after stop%(n+1) callbacks. On any other input,
// and on any text handed to it as an object or array, it returns without a
// panic. Seeds: the other targets' corpora (FuzzParse,
// FuzzParseUsage, and the data lines of FuzzStreamParser), a small chatBody
// (with a 4 KB one the fuzzer spends its time minimizing that body's
// mutations) and the edge cases below; testdata/fuzz/FuzzWalk holds the
// inputs a 60 s run found new coverage with.
func FuzzWalk(f *testing.F) {
	for _, s := range []string{
		`{}`, `[]`, ` { } `, "\t[\n]\r", `{"a":{},"b":[],"c":[{},[[]],{"d":{}}]}`,
		`{"k\"ey":1,"k\\ey":2,"k\/ey":3,"\u00e9t\u00E9":4,"\ud83d\ude00":5,"":6,"a\u0000b":7}`,
		`["\ud83d\ude00","\ud800","\udc00\ud800","\ud800\u0041","\uD83D\uDE00x","\\","\"","\\\"","a\\"]`,
		`[0,-0,1e5,1E+5,-1.5e-300,1e400,-1e400,12.5E-3,123456789012345678901234567890,0.1]`,
		` { "a" : [ 1 , "x" , true , false , null , { "b" : [ ] } ] , "c" : "" } `,
		"{\n\t\"model\"\r:\n\"m\" ,\"messages\":\t[ {\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]} ]}",
		`{"a":1,"a":2,"a":[3],"a":{"a":"a"}}`, `"str"`, `12`, `true`, `null`,
		`{"s":"` + strings.Repeat("lorem ipsum ", 9) + `\n` + strings.Repeat("dolor \"sit\" ", 5) + `"}`,
		`{"caf\u00e9":"caf` + "\u00e9 \u4e16\u754c" + `","x":"` + "\xff\xfe" + `"}`,
		`{"nvext":{"annotations":["a",1,"b"],"agent_hints":{"osl":300,"iat":2.5e2,"prefix_id":"p"}}}`,
	} {
		f.Add([]byte(s), uint8(0))
		f.Add([]byte(s), uint8(2))
	}
	f.Add(chatBody(600), uint8(7))
	for _, seed := range corpusSeeds(f, "FuzzParse", "FuzzParseUsage", "FuzzStreamParser") {
		f.Add(seed, uint8(len(seed)))
	}
	f.Fuzz(func(t *testing.T, body []byte, stop uint8) {
		// Any text taken as an object or array: the walk only returns.
		walkAny(gjson.Result{Type: gjson.JSON, Raw: string(body)}, 64)
		top := gjson.Parse(view(body))
		if !wellFormed(body) {
			walkAny(top, 64)
			return
		}
		sameWalk(t, top, stop)
	})
}

// corpusSeeds reads the []byte arguments of the named targets' corpora under
// testdata/fuzz, and the "data:" lines of those that hold event streams.
func corpusSeeds(f *testing.F, targets ...string) [][]byte {
	f.Helper()
	var seeds [][]byte
	for _, target := range targets {
		files, err := filepath.Glob(filepath.Join("testdata", "fuzz", target, "*"))
		if err != nil || len(files) == 0 {
			f.Fatalf("no corpus for %s: %v", target, err)
		}
		for _, file := range files {
			text, err := os.ReadFile(file)
			if err != nil {
				f.Fatal(err)
			}
			for _, line := range strings.Split(string(text), "\n") {
				lit, ok := strings.CutPrefix(line, "[]byte(")
				if !ok {
					continue
				}
				arg, err := strconv.Unquote(strings.TrimSuffix(lit, ")"))
				if err != nil {
					f.Fatalf("%s: %v", file, err)
				}
				seeds = append(seeds, []byte(arg))
				for _, ev := range strings.Split(arg, "\n") {
					if data, ok := strings.CutPrefix(ev, "data:"); ok {
						seeds = append(seeds, bytes.TrimSpace([]byte(data)))
					}
				}
			}
		}
	}
	return seeds
}

// TestWalkStops checks eachField and eachElem: they stop at the first error
// and return it, with the element indexes counted from 0.
func TestWalkStops(t *testing.T) {
	errStop := fmt.Errorf("stop")
	var keys []string
	err := eachField(gjson.Parse(`{"a":1,"b\u0021":"x","c":[1]}`), func(k string, v gjson.Result) error {
		keys = append(keys, k)
		if k == "b!" {
			return errStop
		}
		return nil
	})
	if err != errStop || strings.Join(keys, ",") != "a,b!" {
		t.Fatalf("eachField: keys %q, err %v", keys, err)
	}
	var idx []int
	err = eachElem(gjson.Parse(` [ {}, [ ], "]", 3 ] `), func(i int, v gjson.Result) error {
		idx = append(idx, i)
		if v.Raw == "3" {
			return errStop
		}
		return nil
	})
	if err != errStop || fmt.Sprint(idx) != "[0 1 2 3]" {
		t.Fatalf("eachElem: indexes %v, err %v", idx, err)
	}
}
