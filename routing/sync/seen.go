package sync

import "time"

// seenIDs counts the messages of replica ids that hold no peer slot (the
// slots were full, or they were evicted as newcomers), so that an id's
// claim to a slot grows with what it sends: a real replica's heartbeats
// add up while forged ids that each send one message do not. It holds at
// most max ids; past that a newly heard id replaces one of a few sampled
// entries, the one heard the fewest times (so an id heard many times
// stays). Guarded by Syncer.rmu.
type seenIDs struct {
	max int
	ids map[string]seenID
}

type seenID struct {
	msgs uint64
	last time.Time
}

// seenSample is how many entries a full table looks at to choose the one
// a new id replaces.
const seenSample = 8

// hear counts a message of id and returns how many were heard from it.
func (t *seenIDs) hear(id string, now time.Time) uint64 {
	e, ok := t.ids[id]
	e.msgs++
	e.last = now
	if !ok {
		t.makeRoom()
	}
	t.ids[id] = e
	return e.msgs
}

// put keeps an evicted peer's count.
func (t *seenIDs) put(id string, msgs uint64, last time.Time) {
	if _, ok := t.ids[id]; !ok {
		t.makeRoom()
	}
	t.ids[id] = seenID{msgs: msgs, last: last}
}

func (t *seenIDs) forget(id string) { delete(t.ids, id) }

// makeRoom drops one entry when the table is full: of seenSample entries
// (map order, which Go randomises), the one heard the fewest times, the
// longest ago among equals.
func (t *seenIDs) makeRoom() {
	if t.ids == nil {
		t.ids = make(map[string]seenID)
	}
	if len(t.ids) < t.max {
		return
	}
	var victim string
	var v seenID
	n := 0
	for id, e := range t.ids {
		if victim == "" || e.msgs < v.msgs || (e.msgs == v.msgs && e.last.Before(v.last)) {
			victim, v = id, e
		}
		if n++; n == seenSample {
			break
		}
	}
	delete(t.ids, victim)
}
