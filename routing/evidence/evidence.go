// Package evidence keeps a learned quantity as the sum of what each of its
// sources taught it, so that one source's share can be taken out again:
// the replica's own outcomes and each peer replica's are kept apart, and
// a peer's teaching is undone when it leaves (routing.PeerForgetter).
//
// A [Set] holds the parts of one quantity in natural parameters: a weight
// W (a precision, an average's weight, a count), the weighted sum S of the
// values (W·mean) and the observations N. Every observation, whatever its
// source, first discounts every part by the same factor (the quantity's
// forgetting) and then adds its weight to its own source's part. Both
// steps are linear, so the sum of the parts is, up to rounding, exactly
// the accumulator a single part would hold after the same observations;
// each part's weight is its source's share of the quantity's recent,
// discounted evidence; and removing a part leaves the sum of the others,
// as if that source's observations had carried no weight (their
// forgetting of the other parts stays: it cannot be told apart).
//
// [Sources] interns peer replica ids as small [Source] numbers, at most a
// fixed number at a time, and orders recording a peer's evidence against
// forgetting it.
package evidence

import (
	"math"
	"slices"
)

// Source is where evidence came from: [Local] or a peer replica interned
// by [Sources]. A Source is never reused for another peer.
type Source uint64

// Local is this replica's own evidence (and the prior).
const Local Source = 0

// Part is one source's evidence: weight W, weighted sum S (W times the
// part's mean) and observations N.
type Part struct {
	W, S float64
	N    int
}

// Mean is S/W (0 for a part without weight).
func (p Part) Mean() float64 {
	if !(p.W > 0) {
		return 0
	}
	return p.S / p.W
}

// Renormalisation bounds of a Set's common scale, and the weight below
// which a peer's part is dropped then: far under the rounding of the sum
// (float64's epsilon is 2.2e-16), it can no longer matter.
const (
	minScale   = 1e-100
	maxScale   = 1e100
	dropWeight = 1e-18
)

// Set is the evidence of this replica and its peers about one quantity.
// Parts are stored divided by a common scale, so that discounting them
// all costs one multiplication; peers' parts are a slice sorted by
// Source (a binary search finds one; a map costs about 350 bytes from its
// first entry, the slice 32 bytes a part). The zero value is an empty
// set. A Set is not safe for concurrent use: its owner's lock guards it.
type Set struct {
	scale float64 // 0: 1 (the zero value)
	local Part
	peers []peerPart
}

type peerPart struct {
	src Source
	Part
}

// find returns src's index in s.peers, or where it would go.
func (s *Set) find(src Source) (int, bool) {
	return slices.BinarySearchFunc(s.peers, src, func(p peerPart, src Source) int {
		switch {
		case p.src < src:
			return -1
		case p.src > src:
			return 1
		}
		return 0
	})
}

func (s *Set) norm() float64 {
	if s.scale == 0 {
		s.scale = 1
	}
	return s.scale
}

// Scale multiplies every part's weight and sum by f: f < 1 is the
// quantity's forgetting at an observation (0 forgets everything: Reset),
// f > 1 renormalises what is left after a removal. A negative, NaN or
// infinite f changes nothing. It costs O(1), except once in a while (the
// scale passed 1e±100) O(parts).
func (s *Set) Scale(f float64) {
	if f == 0 {
		s.Reset()
		return
	}
	if !(f > 0) || math.IsInf(f, 0) {
		return
	}
	s.scale = s.norm() * f
	if s.scale < minScale || s.scale > maxScale {
		s.renormalise()
	}
}

// renormalise folds the scale into the parts and drops peers' parts
// whose weight no longer counts.
func (s *Set) renormalise() {
	k := s.scale
	s.scale = 1
	s.local.W *= k
	s.local.S *= k
	total := s.local.W
	for i := range s.peers {
		p := &s.peers[i]
		p.W *= k
		p.S *= k
		total += p.W
	}
	s.peers = slices.DeleteFunc(s.peers, func(p peerPart) bool { return !(p.W > dropWeight*total) })
}

// Add adds weight w, weighted sum ws (w times the value) and n
// observations to src's part.
func (s *Set) Add(src Source, w, ws float64, n int) {
	k := s.norm()
	if src == Local {
		s.local.W += w / k
		s.local.S += ws / k
		s.local.N += n
		return
	}
	i, ok := s.find(src)
	if !ok {
		s.peers = slices.Insert(s.peers, i, peerPart{src: src})
	}
	p := &s.peers[i]
	p.W += w / k
	p.S += ws / k
	p.N += n
}

// Part returns src's part (the zero Part when src taught nothing).
func (s *Set) Part(src Source) Part {
	p := s.local
	if src != Local {
		i, ok := s.find(src)
		if !ok {
			return Part{}
		}
		p = s.peers[i].Part
	}
	k := s.norm()
	return Part{W: p.W * k, S: p.S * k, N: p.N}
}

// Total returns the sum of the parts: the quantity as a single
// accumulator of every observation would hold it, up to rounding.
func (s *Set) Total() Part {
	t := s.local
	for _, p := range s.peers {
		t.W += p.W
		t.S += p.S
		t.N += p.N
	}
	k := s.norm()
	return Part{W: t.W * k, S: t.S * k, N: t.N}
}

// Remove takes src's part out and returns it; ok is false when src had
// none. Local cannot be removed.
func (s *Set) Remove(src Source) (p Part, ok bool) {
	if src == Local {
		return Part{}, false
	}
	i, ok := s.find(src)
	if !ok {
		return Part{}, false
	}
	q := s.peers[i].Part
	s.peers = slices.Delete(s.peers, i, i+1)
	if len(s.peers) == 0 {
		s.peers = nil // no peer left: free the array
	}
	k := s.norm()
	return Part{W: q.W * k, S: q.S * k, N: q.N}, true
}

// Peers is the number of peers' parts.
func (s *Set) Peers() int { return len(s.peers) }

// Reset empties the set.
func (s *Set) Reset() { *s = Set{} }
