package routing

import (
	"errors"
	"fmt"
	"strings"
)

// Role is what an endpoint does in a prefill/decode disaggregated pool:
// prefill only, decode only, or both (the default: an ordinary aggregated
// worker). A pool with no prefill-role endpoint routes every request
// aggregated.
type Role uint8

// Roles. The zero value is RoleBoth.
const (
	RoleBoth Role = iota
	RolePrefill
	RoleDecode
)

// ErrUnknownRole is wrapped by [ParseRole]'s errors.
var ErrUnknownRole = errors.New("unknown role")

// maxQuotedRole bounds the bytes of a refused role value quoted in an
// error (it comes from a record or a Pod label someone else wrote).
const maxQuotedRole = 64

// ParseRole parses a role as discovery records, Pod labels and flags spell
// it, case-insensitively: "" or "both" or "prefill-decode" (llm-d's name)
// is RoleBoth, "prefill" RolePrefill, "decode" RoleDecode. Anything else
// is an error wrapping ErrUnknownRole.
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "both", "prefill-decode":
		return RoleBoth, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	if len(s) > maxQuotedRole {
		s = s[:maxQuotedRole] + "..."
	}
	return RoleBoth, fmt.Errorf("%w %q (want prefill, decode, both or prefill-decode)", ErrUnknownRole, s)
}

// String returns "both", "prefill" or "decode" (the metric label and the
// JSON value).
func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return "both"
}

// Prefills reports whether the role may run a request's prefill (prefill
// or both).
func (r Role) Prefills() bool { return r != RoleDecode }

// Decodes reports whether the role may run a request's decode (decode or
// both).
func (r Role) Decodes() bool { return r != RolePrefill }

// MarshalText implements [encoding.TextMarshaler] (JSON and YAML records).
func (r Role) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText implements [encoding.TextUnmarshaler] with [ParseRole]: an
// unknown value refuses the whole record.
func (r *Role) UnmarshalText(b []byte) error {
	v, err := ParseRole(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}
