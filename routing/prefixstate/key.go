package prefixstate

import (
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"strings"
)

// Limits of the strings a [Key] stores.
const (
	// MaxIDLen is the longest tenant or prefix id stored as given, in
	// bytes. A longer one is stored as its hash (see [BoundID]).
	MaxIDLen = 256
	// HashedPrefix starts every id that [BoundID] replaced by its hash.
	// No id is stored as given if it starts with it, so a client cannot
	// send an id equal to another id's hash.
	HashedPrefix = "sha256:"
	// hashedLen is the length of a hashed id: HashedPrefix and 64 hex
	// digits.
	hashedLen = len(HashedPrefix) + 2*sha256.Size
)

// Key identifies a prefix group. The tenant keeps one tenant from steering
// another's affinity with a guessed prefix id.
//
// Tenant and PrefixID come from clients (a header the gateway sets, a hint
// header or the request body), so the store never keeps them as given when
// they are long: every Key that enters the store goes through [NewKey],
// which bounds both with [BoundID]. Callers may build a Key as a literal;
// the store bounds it on the way in. A Key from NewKey is bounded already
// and is not hashed again.
type Key struct {
	Tenant   string
	PrefixID string

	// bounded is set by NewKey: both ids went through BoundID.
	bounded bool
}

// NewKey returns the key for (tenant, prefixID) with both ids bounded by
// [BoundID]: at most MaxIDLen bytes each, and distinct ids stay distinct
// (two tenants never share state). Hashing a long id costs one SHA-256 pass
// over it; the store does not hash a NewKey key again.
func NewKey(tenant, prefixID string) Key {
	return Key{Tenant: BoundID(tenant), PrefixID: BoundID(prefixID), bounded: true}
}

// bound returns k as NewKey would make it.
func (k Key) bound() Key {
	if k.bounded {
		return k
	}
	return NewKey(k.Tenant, k.PrefixID)
}

// BoundID is the one rule for client-supplied ids kept beyond a request's
// life (tenants and prefix ids in the prefix state, the decision log): an
// id of at most MaxIDLen bytes that does not start with HashedPrefix is
// returned as is; any other is replaced by HashedPrefix and the hex
// SHA-256 of the whole id (71 bytes).
//
// The result is never longer than MaxIDLen bytes, and BoundID is injective
// as far as SHA-256 is collision resistant: ids kept as is never start with
// HashedPrefix and hashed ones always do, so a short id cannot equal a long
// id's hash, and no truncation ever merges two ids. It is not idempotent
// (a hashed id starts with HashedPrefix, so it is hashed again); apply it
// once, as [NewKey] does.
func BoundID(id string) string {
	if len(id) <= MaxIDLen && !strings.HasPrefix(id, HashedPrefix) {
		return id
	}
	return hashID(sha256.New(), id)
}

// hashID returns HashedPrefix and the hex SHA-256 of id, hashing id in
// chunks through a stack buffer so that a long id is never copied whole.
func hashID(h hash.Hash, id string) string {
	var chunk [512]byte
	for len(id) > 0 {
		n := copy(chunk[:], id)
		h.Write(chunk[:n])
		id = id[n:]
	}
	var sum [sha256.Size]byte
	var out [hashedLen]byte
	copy(out[:], HashedPrefix)
	hex.Encode(out[len(HashedPrefix):], h.Sum(sum[:0]))
	return string(out[:])
}
