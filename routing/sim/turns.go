package sim

import (
	"math"
	"slices"
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// This file holds the requests that wait for their replica's turn in a
// burst (routing/burst, engine.Options.ExternalTurns): the simulator
// routes them at the time the engine's Turn gave, in virtual time.

// heldRequest is request i, entered through rep, to be routed at at
// (offset from the trace start).
type heldRequest struct {
	at  time.Duration
	seq uint64
	i   int
	rep *replica
	req *routing.Request
}

// heldQueue is the held requests by time, then by when they were held.
type heldQueue struct {
	items []heldRequest
	seq   uint64
}

func (q *heldQueue) push(h heldRequest) {
	q.seq++
	h.seq = q.seq
	j, _ := slices.BinarySearchFunc(q.items, h, func(a, b heldRequest) int {
		if a.at != b.at {
			if a.at < b.at {
				return -1
			}
			return 1
		}
		if a.seq < b.seq {
			return -1
		}
		return 1
	})
	q.items = slices.Insert(q.items, j, h)
}

// next is the earliest held request's time (never: none).
func (q *heldQueue) next() time.Duration {
	if len(q.items) == 0 {
		return time.Duration(math.MaxInt64)
	}
	return q.items[0].at
}

func (q *heldQueue) pop() heldRequest {
	h := q.items[0]
	q.items = q.items[1:]
	return h
}
