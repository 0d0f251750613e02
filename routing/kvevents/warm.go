package kvevents

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// This file holds what the warm start (issue 22) needs of a Sub: holding
// the stream while a peer replica's state is fetched, exporting this
// Sub's state between two messages, resuming at a peer's sequence number
// with its trust, and regaining trust as the worker's cache turns over.
//
// # Resuming at a peer's state
//
// A replica that starts subscribes first, with Config.Hold: messages are
// queued (within the queue's bounds; past them dropped, which shows as a
// gap) and not applied. Then it fetches a peer's state: the peer's index
// entries for the worker exported at its sequence S, and whether its
// view was whole (Export). [Sub.Resume] hands them to the apply
// goroutine, which looks at the first message queued:
//
//   - none, or one at or below S+1: the peer's state is imported
//     (Resume.Restore), S becomes the last message applied and the peer's
//     trust this Sub's; the queued messages at or below S are dropped as
//     covered (the peer applied them), the others applied in order;
//   - one above S+1: the worker published messages the peer had not
//     applied when it exported and that this Sub did not receive (they
//     went out before the subscription reached the worker). Resume
//     returns ErrBehind and the Sub keeps holding: fetch again (the peer
//     will have caught up) or Release.
//
// If the first message to arrive after a resume with an empty queue is
// above S+1, that is a gap like any other: replay when configured, else
// the view is untrusted; Deps.OnResumeGap lets the caller fetch again
// (Hold, then Resume). [Sub.Release] starts the stream as without Hold:
// the first message decides trust.
//
// One case is not told apart: a worker that restarts between the
// subscription and the export (a window of the fetch's length, about
// 100 ms) sends small sequence numbers again, which the resume takes for
// messages the peer's state covers. The view then holds the worker's
// blocks from before its restart until its next message, whose sequence
// number is below the peer's: that reads as a restart (the view is
// cleared, and untrusted unless it is the worker's first message).
//
// # Regaining trust as the cache turns over
//
// Without a peer's state or a replay, a view that missed messages (a late
// start, a gap, a message that did not decode) is untrusted. Every block
// the worker's GPU cache held then was stored before the hole or after
// it; those stored after are indexed (their Stored events arrive). Once
// the worker has stored, since the last hole, as many GPU blocks as its
// cache holds on each rank (Config.CacheBlocks or SetCacheBlocks:
// vllm:cache_config_info's num_gpu_blocks), every block from before the
// hole that is still cached has survived a whole turnover of the cache:
// an engine evicting least recently used blocks keeps it only if it was
// used since. The view is trusted again then. What it can still miss are
// such hot blocks (stored before the hole and reused since), and blocks
// stored since whose parent was one of them (kvindex refuses a Stored
// event with an unknown parent): both are false negatives (a block the
// worker holds that the index does not show), never false positives. A
// view the index cut short at its caps (kvindex.ErrWorkerFull) does not
// regain trust this way: blocks it refused are still cached.

// ErrBehind is returned by Resume when the Sub's first queued message is
// past the resumed sequence number plus one: messages between them are
// missing. The Sub keeps holding.
var ErrBehind = errors.New("kvevents: the worker's stream is ahead of the state to resume")

// ErrClosed is returned by the warm-start calls of a closed Sub.
var ErrClosed = errors.New("kvevents: subscription closed")

// StreamState is a Sub's state between two messages.
type StreamState struct {
	// Started says a message was seen; without it the rest means nothing.
	Started bool
	// Trusted says the view is whole.
	Trusted bool
	// Seq is the last message applied.
	Seq uint64
}

// Resume is a peer's state to resume a held Sub at.
type Resume struct {
	StreamState
	// Restore imports the peer's index entries for the worker's ranks. It
	// runs on the apply goroutine, with no event applied concurrently, if
	// the resume goes ahead. An error makes the view untrusted (the
	// entries it did import stay).
	Restore func() error
}

// warmState is the apply goroutine's warm-start and turnover state.
type warmState struct {
	holding bool
	// held is a message taken off the queue to look at its sequence
	// number while holding; it is applied first once the Sub runs.
	held []message
	// covering counts the messages queued at the resume that may be
	// covered by the resumed state.
	covering int
	// resumed is set from a resume to the first message after it.
	resumed bool

	// Turnover: GPU blocks stored per rank since the last hole, and
	// whether the index refused blocks over its caps.
	stored  []uint64
	limited bool
}

func (w *warmState) init(cfg *Config) {
	w.holding = cfg.Hold
	w.stored = make([]uint64, max(cfg.Ranks, 1))
}

// next returns the held message, if any.
func (w *warmState) next() (message, bool) {
	if len(w.held) == 0 {
		return message{}, false
	}
	m := w.held[0]
	w.held = w.held[1:]
	return m, true
}

// hole starts counting the turnover again: the view missed something.
func (w *warmState) hole() { clear(w.stored) }

// cleared says the worker's cache is known again (a clear, a restart).
func (w *warmState) cleared() {
	clear(w.stored)
	w.limited = false
}

// control is one warm-start request for the apply goroutine.
type control struct {
	kind   controlKind
	export func(StreamState)
	resume *Resume
	done   chan error
}

type controlKind uint8

const (
	ctrlExport controlKind = iota
	ctrlResume
	ctrlRelease
	ctrlHold
)

// call sends c to the apply goroutine and waits for its answer, ctx or
// the Sub's end.
func (s *Sub) call(ctx context.Context, c control) error {
	c.done = make(chan error, 1)
	select {
	case s.ctrl <- c:
	case <-ctx.Done():
		return ctx.Err()
	case <-s.ctx.Done():
		return ErrClosed
	}
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		// The request runs anyway; its answer is dropped.
		return ctx.Err()
	case <-s.ctx.Done():
		return ErrClosed
	}
}

// Export calls fn on the apply goroutine between two messages, with the
// stream's state then, so that fn can export the index entries of the
// endpoint at exactly that point (no event of the worker is applied while
// fn runs). A holding Sub is not started. It returns once fn returned, or
// with ctx's error or ErrClosed (fn may then still run).
func (s *Sub) Export(ctx context.Context, fn func(StreamState)) error {
	return s.call(ctx, control{kind: ctrlExport, export: fn})
}

// Resume resumes a held Sub at r (see the file comment): nil once the
// peer's state is imported and the Sub runs from it, ErrBehind when the
// queued stream is ahead of it (the Sub keeps holding), ErrClosed, or
// ctx's error. An r that is not Started releases the Sub as Release
// does. On a Sub that does not hold, it returns an error and changes
// nothing.
func (s *Sub) Resume(ctx context.Context, r Resume) error {
	return s.call(ctx, control{kind: ctrlResume, resume: &r})
}

// Release makes a held Sub run as without Hold: the first message decides
// trust. It does nothing to a Sub that does not hold.
func (s *Sub) Release(ctx context.Context) error {
	return s.call(ctx, control{kind: ctrlRelease})
}

// Hold makes a running Sub hold again (to Resume it at a fresher state
// after Deps.OnResumeGap); it applies nothing until Resume or Release.
func (s *Sub) Hold(ctx context.Context) error {
	return s.call(ctx, control{kind: ctrlHold})
}

// SetCacheBlocks sets the worker's GPU cache size in blocks per rank,
// which decides when an untrusted view regains trust (see the file
// comment); n <= 0 leaves it unchanged.
func (s *Sub) SetCacheBlocks(n int) {
	if n > 0 {
		s.cache.Store(int64(n))
	}
}

// control runs a warm-start request on the apply goroutine.
func (s *Sub) control(c control) {
	var err error
	switch c.kind {
	case ctrlExport:
		st := StreamState{}
		if !s.warm.holding && s.started {
			st = StreamState{Started: true, Trusted: s.trust == 1, Seq: s.last}
		}
		c.export(st)
	case ctrlResume:
		err = s.resume(c.resume)
	case ctrlRelease:
		s.setHolding(false)
	case ctrlHold:
		s.setHolding(true)
	}
	c.done <- err
}

func (s *Sub) setHolding(h bool) {
	s.warm.holding = h
	s.holdingNow.Store(h)
}

// resume is Resume on the apply goroutine.
func (s *Sub) resume(r *Resume) error {
	if !s.warm.holding {
		return fmt.Errorf("kvevents: %s: resume of a subscription that does not hold", s.cfg.Endpoint)
	}
	if !r.Started {
		s.setHolding(false)
		return nil
	}
	if len(s.warm.held) == 0 {
		select {
		case m, ok := <-s.queue:
			if ok {
				s.warm.held = append(s.warm.held, m)
			}
		default:
		}
	}
	if len(s.warm.held) > 0 {
		if seq, ok := seqOf(s.warm.held[0].frames); ok && seq > r.Seq+1 {
			return fmt.Errorf("%w: first queued message %d, state at %d", ErrBehind, seq, r.Seq)
		}
	}
	trusted := r.Trusted
	if r.Restore != nil {
		if err := r.Restore(); err != nil {
			s.log.Warn("kv events: the peer's state did not import whole, view is approximate", "err", err)
			trusted = false
			if errors.Is(err, kvindex.ErrWorkerFull) || errors.Is(err, kvindex.ErrTooManyBlockSizes) {
				s.warm.limited = true
			}
		}
	}
	s.started, s.last = true, r.Seq
	s.warm.hole()
	s.warm.covering = len(s.warm.held) + len(s.queue)
	s.warm.resumed = true
	s.setHolding(false)
	s.setTrust(trusted)
	return nil
}

// covers drops a message queued before the resume that the resumed state
// already held; it reports whether it did.
func (s *Sub) covers(m message) bool {
	if s.warm.covering == 0 {
		return false
	}
	s.warm.covering--
	seq, ok := seqOf(m.frames)
	if !ok || seq > s.last {
		return false
	}
	s.c.covered.Add(1)
	return true
}

// resumeGap tells the caller that the first message after a resume left a
// gap (Deps.OnResumeGap).
func (s *Sub) resumeGap() {
	if s.warm.resumed && s.deps.OnResumeGap != nil {
		s.deps.OnResumeGap(s.cfg.Endpoint)
	}
	s.warm.resumed = false
}

// turnover counts a GPU Stored event's blocks towards regaining trust, and
// regains it once every rank stored a whole cache's worth since the last
// hole (see the file comment). Refused events count: the blocks they name
// went into the cache all the same.
func (s *Sub) turnover(rank int, ev *kvindex.Event) {
	if ev.Kind != kvindex.Stored || ev.Medium != kvindex.MediumGPU || s.trust != 0 {
		return
	}
	if rank >= 0 && rank < len(s.warm.stored) {
		s.warm.stored[rank] += uint64(len(ev.Blocks))
	}
	c := s.cache.Load()
	if c <= 0 || s.warm.limited {
		return
	}
	for _, n := range s.warm.stored {
		if n < uint64(c) {
			return
		}
	}
	s.c.turnovers.Add(1)
	s.log.Info("kv events: the worker's cache turned over since the view missed messages: trusted again", "cache_blocks", c)
	s.setTrust(true)
}
