package evidence

import (
	"sync"
	"sync/atomic"
)

// MaxPeers is the default bound of [Sources]: routing/sync's
// DefaultMaxPeers, the peers one replica tracks at most (a test keeps the
// two equal).
const MaxPeers = 256

// Sources interns peer replica ids as [Source] numbers, at most max at a
// time, so that a learner keys its parts by eight bytes rather than by the
// peer's id (up to routing.MaxRemoteString bytes). It is safe for
// concurrent use.
//
// It also orders recording a peer's evidence ([Sources.Use]) against
// forgetting it ([Sources.Forget]): a peer's outcome being learnt while
// the peer is forgotten is either forgotten with it or not recorded, never
// left behind for a Source nobody will forget again.
type Sources struct {
	// use is held for reading while a peer's evidence is recorded, for
	// writing while sources are interned or forgotten.
	use  sync.RWMutex
	max  int
	next Source
	ids  map[string]*entry
	tick atomic.Uint64
}

type entry struct {
	src  Source
	used atomic.Uint64 // Sources.tick at its last use
}

// NewSources returns an empty table of at most max peers (max < 1:
// MaxPeers).
func NewSources(max int) *Sources {
	if max < 1 {
		max = MaxPeers
	}
	return &Sources{max: max, next: Local + 1, ids: make(map[string]*entry)}
}

// Use calls record with peer's Source, interning peer when it is new.
// When the table is full, the least recently used peer is dropped first
// and forget is called with its Source, as [Sources.Forget] would: every
// learner's part for it must go (a peer that left, or one of more peers
// than a replica tracks). Both run with the table locked against
// Forget, record shared with other Use calls, forget exclusive; neither
// may call back into the table.
func (s *Sources) Use(peer string, forget, record func(Source)) {
	s.use.RLock()
	if e, ok := s.ids[peer]; ok {
		e.used.Store(s.tick.Add(1))
		record(e.src)
		s.use.RUnlock()
		return
	}
	s.use.RUnlock()

	s.use.Lock()
	defer s.use.Unlock()
	e, ok := s.ids[peer]
	if !ok {
		if len(s.ids) >= s.max {
			s.evict(forget)
		}
		e = &entry{src: s.next}
		s.next++
		s.ids[peer] = e
	}
	e.used.Store(s.tick.Add(1))
	record(e.src)
}

// evict drops the least recently used peer and forgets it. s.use is held.
func (s *Sources) evict(forget func(Source)) {
	var oldest string
	var at uint64
	first := true
	for id, e := range s.ids {
		if u := e.used.Load(); first || u < at {
			oldest, at, first = id, u, false
		}
	}
	if first {
		return
	}
	src := s.ids[oldest].src
	delete(s.ids, oldest)
	forget(src)
}

// Forget drops peer and calls forget with its Source, exclusive of Use;
// it reports false (and calls nothing) for a peer not interned.
func (s *Sources) Forget(peer string, forget func(Source)) bool {
	s.use.Lock()
	defer s.use.Unlock()
	e, ok := s.ids[peer]
	if !ok {
		return false
	}
	delete(s.ids, peer)
	forget(e.src)
	return true
}

// Len is the number of peers interned.
func (s *Sources) Len() int {
	s.use.RLock()
	defer s.use.RUnlock()
	return len(s.ids)
}
