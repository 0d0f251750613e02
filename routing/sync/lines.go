package sync

import (
	"context"
	"log/slog"
	stdsync "sync"
	"time"
)

// Peer lifecycle log lines (a peer joined, restarted, went silent) are
// driven by what peers send, so a hostile or broken client can make them
// as often as it publishes: 26-byte heartbeats claiming one peer id with
// alternating epochs wrote 520k-590k "restarted" lines in 10 s before
// this bound. At most peerLinesBurst of them are written per
// peerLinesWindow; the first line of the next window says how many were
// held back.
const (
	peerLinesBurst  = 20
	peerLinesWindow = time.Minute
)

// lineBudget lets at most burst lines through per window and counts the
// others.
type lineBudget struct {
	mu     stdsync.Mutex
	burst  int
	window time.Duration
	start  time.Time
	n      int
	held   int
}

// take reports whether a line may be written at now, and how many lines
// the window that just ended held back (reported with this line).
func (b *lineBudget) take(now time.Time) (ok bool, held int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Sub(b.start) >= b.window {
		held = b.held
		b.start, b.n, b.held = now, 0, 0
	}
	if b.n >= b.burst {
		b.held++
		return false, 0
	}
	b.n++
	return true, held
}

// peerLine writes a peer lifecycle line within the budget.
func (s *Syncer) peerLine(now time.Time, level slog.Level, msg string, args ...any) {
	ok, held := s.peerLines.take(now)
	if !ok {
		return
	}
	if held > 0 {
		args = append(args, "peer_lines_held_back", held)
	}
	s.log.Log(context.Background(), level, msg, args...)
}
