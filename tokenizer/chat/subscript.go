package chat

import (
	"errors"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/tokens"
)

// Subscripts.
//
// gonja's Value.GetItem gets Python's negative indexing wrong at the bound:
// it accepts -i only when len > i, so x[-len(x)] is "not found" and renders
// as none. The common victim is x[-1] on a one-element list, which is what
// str.split returns when the separator is absent: Qwen3's template does
// content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'),
// so an assistant turn holding "</think>" without "<think>" called lstrip on
// none and the render failed. messages[-1] on a one-message conversation
// fails the same way. It also indexes strings by byte, not by character.
//
// gonja offers no hook into item access, and the statements that hold
// expressions ({% set %}) keep them in unexported fields, so the parsed tree
// cannot be patched. Instead, the source is rewritten before parsing: every
// subscript x[i] whose index is not a single string literal becomes
// getitemName(x, i), a global with Python's semantics ([getItem]). Subscripts
// with a string-literal key (dict access, which gonja gets right) and slices
// are left alone, as is anything the rewriter cannot place with certainty
// (then gonja's own behaviour remains).
//
// A call through gonja costs about ten allocations, and gonja evaluates a
// method's receiver twice, so a call inside a chain such as
// x.split(a)[0].rstrip(b).split(c)[-1].lstrip(d) runs several times. The
// hottest subscripts in chat templates index the result of str.split, which
// is ours ([splitMethod]): it returns a [pyList], which indexes as Python does
// through gonja's ItemGetter hook, so a subscript applied directly to a
// .split(...) call is left to the engine and costs nothing extra.

// getitemName is the global that rewritten subscripts call. It is not a name
// a chat template would define.
const getitemName = "__kvbandit_getitem"

// getItem is x[key] as Jinja2 evaluates it: integer indexes count from the end
// when negative and index strings by character; an index out of range is
// undefined (none). Other keys go through gonja's own item and attribute
// lookup, as its evaluator does for x[key].
func getItem(_ *exec.Evaluator, params *exec.VarArgs) *exec.Value {
	if len(params.Args) != 2 || len(params.KwArgs) != 0 {
		return exec.AsValue(errors.New(getitemName + " takes two arguments"))
	}
	v, key := params.Args[0], params.Args[1]
	switch {
	case key.IsInteger() && v.IsString():
		s := v.String()
		i := key.Integer()
		if i < 0 {
			i += utf8.RuneCountInString(s)
			if i < 0 {
				return exec.AsValue(nil)
			}
		}
		for _, r := range s {
			if i == 0 {
				return exec.AsValue(string(r))
			}
			i--
		}
		return exec.AsValue(nil)
	case key.IsInteger() && v.IsList():
		i := key.Integer()
		if i < 0 {
			i += v.Len()
		}
		if i < 0 || i >= v.Len() {
			return exec.AsValue(nil)
		}
		return v.Index(i)
	}
	// The rest of gonja's evalGetItem.
	var k any
	switch {
	case key.IsString():
		k = key.String()
	case key.IsInteger():
		k = key.Integer()
	default:
		return exec.AsValue(errors.New("subscript does not evaluate to a string or an integer"))
	}
	item, found := v.GetItem(k)
	if !found && key.IsString() {
		item, found = v.GetAttribute(key.String())
	}
	if !found {
		if item.IsError() {
			return item
		}
		return exec.AsValue(nil)
	}
	return item
}

// edit is one change to the template source: insert text at pos, replacing
// n bytes.
type edit struct {
	pos, n int
	text   string
}

// rewriteSubscripts returns src with its subscripts rewritten into calls to
// getitemName (see above). src is the text gonja will parse; tokens are
// taken from gonja's own lexer so both agree on where expressions, strings
// and brackets are. A source the lexer rejects is returned unchanged (the
// parser reports the error).
func rewriteSubscripts(src string, cfg *config.Config) string {
	if !strings.Contains(src, "[") {
		return src
	}
	// gonja normalises newlines before lexing; token positions refer to the
	// normalised text. Doing the same here changes nothing gonja sees. The
	// trailing newline is kept: gonja removes it when it parses the result.
	src = strings.ReplaceAll(src, "\r\n", "\n")
	src = strings.ReplaceAll(src, "\r", "\n")
	lexCfg := cfg.Inherit()
	lexCfg.KeepTrailingNewline = true

	toks := expressionTokens(src, lexCfg)
	if toks == nil {
		return src
	}
	match := matchBrackets(toks)
	if match == nil {
		return src
	}
	var edits []edit
	for k, t := range toks {
		if t.Type != tokens.LeftBracket || !operandEnd(toks, k-1) {
			continue
		}
		end := match[k]
		if !rewritable(toks[k+1:end]) || splitCall(toks, match, k-1) {
			continue
		}
		start := chainStart(toks, match, k-1)
		if start < 0 {
			continue
		}
		edits = append(edits,
			edit{pos: toks[start].Pos, text: getitemName + "("},
			edit{pos: t.Pos, n: 1, text: ", "},
			edit{pos: toks[end].Pos, n: 1, text: ")"})
	}
	if len(edits) == 0 {
		return src
	}
	// Insertions before replacements at one position; several insertions at
	// one position are the same text.
	sort.SliceStable(edits, func(i, j int) bool {
		if edits[i].pos != edits[j].pos {
			return edits[i].pos < edits[j].pos
		}
		return edits[i].n < edits[j].n
	})
	var b strings.Builder
	b.Grow(len(src) + len(edits)*(len(getitemName)+2))
	last := 0
	for _, e := range edits {
		b.WriteString(src[last:e.pos])
		b.WriteString(e.text)
		last = e.pos + e.n
	}
	b.WriteString(src[last:])
	return b.String()
}

// expressionTokens lexes src and returns the tokens inside {{ }} and {% %},
// without whitespace, each tag's tokens preceded by its opening delimiter
// and followed by its closing one. It returns nil when the lexer fails.
func expressionTokens(src string, cfg *config.Config) []*tokens.Token {
	stream := tokens.LexAll(src, cfg)
	var out []*tokens.Token
	inside := false
	for !stream.End() {
		t := stream.Current()
		stream.Next()
		switch t.Type {
		case tokens.Error:
			return nil
		case tokens.VariableBegin, tokens.BlockBegin, tokens.LinecontrolStructureBegin:
			inside = true
			out = append(out, t)
		case tokens.VariableEnd, tokens.BlockEnd, tokens.LinecontrolStructureEnd:
			inside = false
			out = append(out, t)
		case tokens.Whitespace:
		default:
			if !inside {
				continue
			}
			if !clean(src, t) {
				return nil
			}
			out = append(out, t)
		}
	}
	if stream.IsError() {
		return nil
	}
	return out
}

// clean reports whether a token starts where its text starts. gonja's lexer
// skips characters it does not know (such as # or ?) and folds them into the
// next token, so that token's position is not where its text is. Jinja
// rejects those characters; such a template is not rewritten. Only the
// tokens edits are placed at are checked.
func clean(src string, t *tokens.Token) bool {
	if t.Pos < 0 || t.Pos >= len(src) {
		return false
	}
	r, _ := utf8.DecodeRuneInString(src[t.Pos:])
	switch t.Type {
	case tokens.String:
		return r == '\'' || r == '"'
	case tokens.Name:
		return r == '_' || unicode.IsLetter(r)
	case tokens.Integer, tokens.Float:
		return unicode.IsDigit(r)
	case tokens.LeftBracket, tokens.RightBracket, tokens.LeftParenthesis, tokens.RightParenthesis,
		tokens.LeftBrace, tokens.RightBrace, tokens.Dot, tokens.Pipe:
		return len(t.Val) == 1
	}
	return true
}

// matchBrackets pairs every bracket with its partner: match[i] is the index of
// the partner of toks[i]. It returns nil when they do not pair up within
// each tag.
func matchBrackets(toks []*tokens.Token) []int {
	match := make([]int, len(toks))
	var stack []int
	for i, t := range toks {
		switch t.Type {
		case tokens.LeftBracket, tokens.LeftParenthesis, tokens.LeftBrace:
			stack = append(stack, i)
		case tokens.RightBracket, tokens.RightParenthesis, tokens.RightBrace:
			if len(stack) == 0 || !pairs(toks[stack[len(stack)-1]].Type, t.Type) {
				return nil
			}
			o := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			match[o], match[i] = i, o
		case tokens.VariableBegin, tokens.BlockBegin, tokens.LinecontrolStructureBegin,
			tokens.VariableEnd, tokens.BlockEnd, tokens.LinecontrolStructureEnd:
			if len(stack) != 0 {
				return nil
			}
		}
	}
	if len(stack) != 0 {
		return nil
	}
	return match
}

func pairs(open, closing tokens.Type) bool {
	switch open {
	case tokens.LeftBracket:
		return closing == tokens.RightBracket
	case tokens.LeftParenthesis:
		return closing == tokens.RightParenthesis
	}
	return closing == tokens.RightBrace
}

// keywords are names after which "[" opens a list, not a subscript.
var keywords = map[string]bool{
	"and": true, "or": true, "not": true, "in": true, "is": true, "if": true, "else": true, "elif": true,
	"for": true, "recursive": true, "set": true, "do": true, "with": true, "without": true, "context": true,
	"include": true, "import": true, "from": true, "as": true, "extends": true, "ignore": true,
	"missing": true, "print": true, "filter": true, "call": true, "macro": true, "block": true,
}

// operandEnd reports whether toks[i] ends an operand, so that a "[" after it
// is a subscript.
func operandEnd(toks []*tokens.Token, i int) bool {
	if i < 0 {
		return false
	}
	switch toks[i].Type {
	case tokens.Name:
		// The first name of a statement is its keyword ({% if [..] %}).
		return !keywords[toks[i].Val] && !isTagStart(toks, i-1)
	case tokens.String, tokens.Integer, tokens.Float,
		tokens.RightParenthesis, tokens.RightBracket, tokens.RightBrace:
		return true
	}
	return false
}

func isTagStart(toks []*tokens.Token, i int) bool {
	if i < 0 {
		return true
	}
	switch toks[i].Type {
	case tokens.BlockBegin, tokens.LinecontrolStructureBegin:
		return true
	}
	return false
}

// rewritable reports whether a subscript with these index tokens is
// rewritten: not empty, not a single string literal, and no slice or tuple
// (":" or "," outside nested brackets).
func rewritable(index []*tokens.Token) bool {
	if len(index) == 0 || (len(index) == 1 && index[0].Type == tokens.String) {
		return false
	}
	depth := 0
	for _, t := range index {
		switch t.Type {
		case tokens.LeftBracket, tokens.LeftParenthesis, tokens.LeftBrace:
			depth++
		case tokens.RightBracket, tokens.RightParenthesis, tokens.RightBrace:
			depth--
		case tokens.Colon, tokens.Comma:
			if depth == 0 {
				return false
			}
		}
	}
	return true
}

// splitCall reports whether toks[i] closes a call of a method named split:
// x.split(...). Only our [splitMethod] answers to that name (a Go method name
// is never lower case, and a template cannot store a callable in a dict), and
// it returns a [pyList], which gonja indexes correctly.
func splitCall(toks []*tokens.Token, match []int, i int) bool {
	if i < 0 || toks[i].Type != tokens.RightParenthesis {
		return false
	}
	o := match[i]
	return o >= 2 && toks[o-1].Type == tokens.Name && toks[o-1].Val == "split" && toks[o-2].Type == tokens.Dot
}

// chainStart returns the index of the first token of the postfix chain
// (primary, then .attr, [subscript] and (call) parts) that ends at toks[i],
// which is what a subscript after toks[i] applies to in Jinja's grammar. It
// returns -1 when the chain is not plain (a filter or test name, implicit
// string concatenation, anything unexpected).
func chainStart(toks []*tokens.Token, match []int, i int) int {
	for i >= 0 {
		switch toks[i].Type {
		case tokens.RightBracket, tokens.RightParenthesis:
			o := match[i]
			if !operandEnd(toks, o-1) {
				return o // a list literal or a parenthesised expression
			}
			i = o - 1 // a subscript or a call: continue with its target
		case tokens.RightBrace:
			return match[i] // a dict literal
		case tokens.Name, tokens.Integer:
			if i > 0 && toks[i-1].Type == tokens.Dot {
				if !operandEnd(toks, i-2) {
					return -1
				}
				i -= 2 // .attr: continue with its target
				continue
			}
			if toks[i].Type == tokens.Name && i > 0 && (toks[i-1].Type == tokens.Pipe || toks[i-1].Type == tokens.Is) {
				return -1 // a filter or test, which Jinja does not subscript
			}
			return i
		case tokens.String:
			if i > 0 && toks[i-1].Type == tokens.String {
				return -1
			}
			return i
		case tokens.Float:
			return i
		default:
			return -1
		}
	}
	return -1
}
