package hints

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Session header names. A session id (the prefix id) is read from the
// first of the configured session headers present on a request (serve's
// --session-header, config router.session_header), then from nvext as for
// every hint. The default is [HeaderPrefixID]; production-stack's
// --session-key and the SGLang router's session header name one header of
// their own, which an operator can list instead or as well.
const (
	// MaxSessionHeaders bounds how many session header names are
	// configured (each is looked for on every request).
	MaxSessionHeaders = 8
	// MaxSessionHeaderNameLen bounds one name, in bytes.
	MaxSessionHeaderNameLen = 128
)

// ErrSessionHeader is wrapped by every [SessionHeaders] error.
var ErrSessionHeader = errors.New("invalid session header")

// DefaultSessionHeaders returns the default session header names.
func DefaultSessionHeaders() []string { return []string{HeaderPrefixID} }

// SessionHeaders checks configured session header names and returns them
// lower-cased (HTTP/2 and Envoy carry lower-case names): 1 to
// [MaxSessionHeaders] names, each an HTTP field name (RFC 9110 token) of
// at most [MaxSessionHeaderNameLen] bytes, none repeated, and none of the
// other hint headers (x-prefix-total-requests, x-prefix-osl, x-prefix-iat,
// x-request-priority, the objective headers), whose values mean something
// else. An empty list means the default.
func SessionHeaders(names []string) ([]string, error) {
	if len(names) == 0 {
		return DefaultSessionHeaders(), nil
	}
	if len(names) > MaxSessionHeaders {
		return nil, fmt.Errorf("%w: %d names, at most %d", ErrSessionHeader, len(names), MaxSessionHeaders)
	}
	out := make([]string, 0, len(names))
	for _, n := range names {
		l := strings.ToLower(n)
		switch {
		case l == "":
			return nil, fmt.Errorf("%w: empty name", ErrSessionHeader)
		case len(l) > MaxSessionHeaderNameLen:
			return nil, fmt.Errorf("%w: %q is longer than %d bytes", ErrSessionHeader, n[:16]+"…", MaxSessionHeaderNameLen)
		case !isToken(l):
			return nil, fmt.Errorf("%w: %q is not an HTTP header name", ErrSessionHeader, n)
		case slices.Contains(out, l):
			return nil, fmt.Errorf("%w: %q listed twice", ErrSessionHeader, n)
		case l != HeaderPrefixID && slices.Contains(otherHintHeaders[:], l):
			return nil, fmt.Errorf("%w: %q is another hint's header", ErrSessionHeader, n)
		}
		out = append(out, l)
	}
	return out, nil
}

// otherHintHeaders are the hint headers a session header may not be.
var otherHintHeaders = [...]string{HeaderTotalRequests, HeaderOSL, HeaderIAT, HeaderPriority, HeaderSLOTTFT, HeaderLLMDSLOTTFT, HeaderInferenceObjective}

// isToken reports whether s is an RFC 9110 token (tchar+).
func isToken(s string) bool {
	for i := range len(s) {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return len(s) > 0
}

// WithSessionHeaders returns a Getter that answers [HeaderPrefixID] with
// the first of names (checked by [SessionHeaders]) that g has, and every
// other name as g does. With names empty it returns g.
func WithSessionHeaders(g Getter, names []string) Getter {
	if g == nil || len(names) == 0 || (len(names) == 1 && names[0] == HeaderPrefixID) {
		return g
	}
	return func(name string) (string, bool) {
		if name != HeaderPrefixID {
			return g(name)
		}
		for _, n := range names {
			if v, ok := g(n); ok {
				return v, true
			}
		}
		return "", false
	}
}
