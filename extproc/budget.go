package extproc

import "sync/atomic"

// Budget bounds the request body bytes held at once across every front
// that buffers bodies: the ext_proc server's streams and the standalone
// proxy's requests draw from one Budget (serve makes it once, from
// --max-buffered-bytes, and passes it to both). Callers charge bytes as they
// receive them and release them once the body is no longer needed; a
// charge that would cross the limit is refused, and the caller answers 503
// server_busy ([ErrBufferBudget]).
//
// A Budget is safe for concurrent use; Take and Release are lock-free.
type Budget struct {
	limit int64
	used  atomic.Int64
}

// DefaultMaxBufferedBytes is the budget used when --max-buffered-bytes is
// 0: four bodies of the largest size, at least 256 MiB.
func DefaultMaxBufferedBytes(maxBodyBytes int64) int64 {
	return max(4*maxBodyBytes, 256<<20)
}

// NewBudget returns a budget of limit bytes (at least 1).
func NewBudget(limit int64) *Budget {
	return &Budget{limit: max(limit, 1)}
}

// Take charges n bytes and reports whether they fit; on false nothing is
// charged. n <= 0 always fits.
func (b *Budget) Take(n int64) bool {
	if n <= 0 {
		return true
	}
	for {
		cur := b.used.Load()
		if cur+n > b.limit || cur+n < cur {
			return false
		}
		if b.used.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// Release returns n bytes taken earlier.
func (b *Budget) Release(n int64) {
	if n > 0 {
		b.used.Add(-n)
	}
}

// Used is the number of bytes charged now.
func (b *Budget) Used() int64 { return b.used.Load() }

// Limit is the budget's size in bytes.
func (b *Budget) Limit() int64 { return b.limit }
