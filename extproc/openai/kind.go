package openai

import (
	"errors"
	"fmt"
	"path"
	"strings"
)

// Kind is the OpenAI endpoint a request was sent to.
type Kind uint8

// Request kinds.
const (
	// KindOther is any path that is not one of the two below (models,
	// embeddings, responses, ...): only "model" is read, and it is optional.
	KindOther Kind = iota
	// KindChat is POST /v1/chat/completions.
	KindChat
	// KindCompletion is POST /v1/completions.
	KindCompletion
)

// String returns "chat", "completion" or "other".
func (k Kind) String() string {
	switch k {
	case KindChat:
		return "chat"
	case KindCompletion:
		return "completion"
	}
	return "other"
}

// KindOf classifies an HTTP path (Envoy's :path, query included). The query
// string is cut and the path cleaned with [CleanPath] (so
// /v1/chat/completions/../models is not a chat request); the match is then
// exact and case-sensitive: a trailing slash or a prefix such as
// /openai/v1/... gives KindOther, and so does a path CleanPath rejects.
func KindOf(p string) Kind {
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	p, err := CleanPath(p)
	if err != nil {
		return KindOther
	}
	switch p {
	case "/v1/chat/completions":
		return KindChat
	case "/v1/completions":
		return KindCompletion
	}
	return KindOther
}

// ErrInvalidPath is returned by [CleanPath] for a path that is not absolute,
// is badly percent-encoded, or hides structure in percent-encoding (an
// encoded slash, backslash, percent sign or dot segment) or in control
// characters or a raw backslash.
var ErrInvalidPath = errors.New("invalid request path")

// CleanPath returns the decoded, cleaned form of escaped, an absolute
// request path as it came on the wire (no query string). It decodes
// percent-encoding once and refuses what could mean different things to
// kvbandit and to a worker or a later hop:
//
//   - an encoded '/' (%2F) or '\' (%5C), and a raw '\';
//   - an encoded '%' (%25: double encoding, e.g. %252e);
//   - a dot segment spelt with an encoded dot (%2e, .%2E, ...);
//   - control characters (raw or encoded) and malformed escapes.
//
// The decoded path is then cleaned as [path.Clean] does (repeated slashes
// merged, "." and ".." resolved lexically, never above the root), keeping a
// trailing slash (RFC 3986 section 5.2.4: /a/b/ and /a/b/. end in a slash).
// A path without escapes, backslashes, repeated slashes or dot segments
// is returned unchanged, without allocating.
func CleanPath(escaped string) (string, error) {
	if escaped == "" || escaped[0] != '/' {
		return "", fmt.Errorf("%w: %q is not an absolute path", ErrInvalidPath, truncate(escaped))
	}
	if isClean(escaped) {
		return escaped, nil
	}
	var b strings.Builder
	b.Grow(len(escaped))
	trailing := false
	for seg := range strings.SplitSeq(escaped[1:], "/") {
		dec, encodedDot, err := decodeSegment(seg)
		if err != nil {
			return "", fmt.Errorf("%w: %q: %w", ErrInvalidPath, truncate(escaped), err)
		}
		if encodedDot && (dec == "." || dec == "..") {
			return "", fmt.Errorf("%w: %q: encoded dot segment", ErrInvalidPath, truncate(escaped))
		}
		b.WriteByte('/')
		b.WriteString(dec)
		trailing = dec == "" || dec == "." || dec == ".."
	}
	clean := path.Clean(b.String())
	if trailing && clean != "/" {
		clean += "/"
	}
	return clean, nil
}

// isClean reports whether p needs neither decoding nor cleaning: no '%',
// no backslash, no control character, no empty segment and no dot segment
// (a trailing slash is fine).
func isClean(p string) bool {
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c == '%', c == '\\', c < 0x20, c == 0x7f:
			return false
		case c == '/':
			rest := p[i+1:]
			if strings.HasPrefix(rest, "/") || rest == "." || rest == ".." || strings.HasPrefix(rest, "./") || strings.HasPrefix(rest, "../") {
				return false
			}
		}
	}
	return true
}

var (
	errEncodedSeparator = errors.New("encoded slash or backslash")
	errEncodedPercent   = errors.New("encoded percent sign (double encoding)")
	errControl          = errors.New("control character")
	errBackslash        = errors.New("backslash")
	errBadEscape        = errors.New("malformed percent-encoding")
)

// decodeSegment percent-decodes one path segment and reports whether it
// contained an encoded dot.
func decodeSegment(s string) (string, bool, error) {
	if strings.IndexByte(s, '%') < 0 {
		for i := 0; i < len(s); i++ {
			if err := checkByte(s[i], false); err != nil {
				return "", false, err
			}
		}
		return s, false, nil
	}
	out := make([]byte, 0, len(s))
	encodedDot := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '%' {
			if err := checkByte(c, false); err != nil {
				return "", false, err
			}
			out = append(out, c)
			continue
		}
		if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
			return "", false, errBadEscape
		}
		c = unhex(s[i+1])<<4 | unhex(s[i+2])
		i += 2
		if err := checkByte(c, true); err != nil {
			return "", false, err
		}
		if c == '.' {
			encodedDot = true
		}
		out = append(out, c)
	}
	return string(out), encodedDot, nil
}

func checkByte(c byte, encoded bool) error {
	switch {
	case c < 0x20 || c == 0x7f:
		return errControl
	case encoded && (c == '/' || c == '\\'):
		return errEncodedSeparator
	case c == '\\':
		return errBackslash
	case encoded && c == '%':
		return errEncodedPercent
	}
	return nil
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case c <= '9':
		return c - '0'
	case c <= 'F':
		return c - 'A' + 10
	}
	return c - 'a' + 10
}

// truncate bounds a client-supplied path quoted in an error message.
func truncate(s string) string {
	const limit = 256
	if len(s) > limit {
		return s[:limit] + "..."
	}
	return s
}
