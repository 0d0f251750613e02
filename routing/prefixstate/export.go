package prefixstate

import (
	"cmp"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's side of the store (issue 22): its
// sessions exported for a peer replica that starts, and imported from
// one. Times travel as ages (durations before the export), never as a
// peer's clock readings.

// Export returns up to max sessions (0: all), live ones only, with their
// ages relative to now on the store's clock.
func (s *Store) Export(max int) []warmstate.Session {
	now := s.now()
	var out []warmstate.Session
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for e := sh.lru.next; e != &sh.lru; e = e.next {
			if max > 0 && len(out) >= max {
				break
			}
			if s.expiredAt(e, now) {
				continue
			}
			ws := warmstate.Session{
				Tenant: e.key.Tenant, PrefixID: e.key.PrefixID, Total: e.total, Processed: e.processed,
				IdleMillis: ageMillis(now - e.lastUse),
			}
			if e.pinned {
				p := e.pin
				ws.Pinned, ws.Endpoint, ws.Rank = true, string(p.Endpoint), int32(p.DPRank)
				ws.DecodeCost, ws.PrefillCost, ws.IATFactor = p.DecodeCost, p.PrefillCost, p.IATFactor
				if !p.At.IsZero() {
					ws.PinAgeMillis = ageMillis(now - p.At.UnixNano())
				}
			}
			out = append(out, ws)
		}
		sh.mu.Unlock()
	}
	return out
}

func ageMillis(d int64) uint32 {
	return uint32(min(max(d/int64(time.Millisecond), 0), math.MaxUint32))
}

// Import adds a peer's sessions the store does not hold yet (an entry
// already here is fresher and stays), as recently used as they were on
// the peer, and charges their pins' outstanding work as Pin does. It
// returns how many it took, and how many it left out: known here,
// expired, or out of range (an empty or over-long id, counts out of
// [0, MaxTotalRequests] or processed over an announced total (0: an
// open session), a negative or non-finite
// cost, a rank out of range); the last are counted as malformed.
func (s *Store) Import(in []warmstate.Session) (imported, skipped, malformed int) {
	order := make([]int, 0, len(in))
	for i := range in {
		if !validSession(&in[i]) {
			malformed++
			continue
		}
		order = append(order, i)
	}
	// The most recently used first, each at the back: the list stays in
	// recency order (the back expires first), behind the entries made
	// here since the start.
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(in[a].IdleMillis, in[b].IdleMillis) })
	now := s.now()
	for _, i := range order {
		if s.importOne(&in[i], now) {
			imported++
		} else {
			skipped++
		}
	}
	return imported, skipped, malformed
}

func validSession(ws *warmstate.Session) bool {
	cost := func(v float64) bool { return v >= 0 && !math.IsInf(v, 0) && !math.IsNaN(v) }
	switch {
	case ws.PrefixID == "" || len(ws.PrefixID) > MaxIDLen || len(ws.Tenant) > MaxIDLen:
		return false
	case ws.Total < 0 || ws.Total > MaxTotalRequests || ws.Processed < 0 || ws.Processed > MaxTotalRequests || (ws.Total > 0 && ws.Processed > ws.Total):
		return false
	case !ws.Pinned:
		return true
	case ws.Endpoint == "" || len(ws.Endpoint) > warmstate.MaxStringLen || ws.Rank < -1 || ws.Rank > warmstate.MaxRank:
		return false
	}
	return cost(ws.DecodeCost) && cost(ws.PrefillCost) && cost(ws.IATFactor)
}

// importOne inserts one checked session unless its key is held or it has
// expired.
func (s *Store) importOne(ws *warmstate.Session, now int64) bool {
	lastUse := now - int64(ws.IdleMillis)*int64(time.Millisecond)
	if !s.cfg.NoExpiry && now-lastUse >= int64(s.cfg.TTL) {
		return false
	}
	k := Key{Tenant: strings.Clone(ws.Tenant), PrefixID: strings.Clone(ws.PrefixID), bounded: true}
	sh := s.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, ok := sh.m[k]; ok || len(sh.m) >= sh.cap {
		return false
	}
	e := &entry{key: k, total: ws.Total, processed: ws.Processed, lastUse: lastUse}
	sh.m[k] = e
	e.prev, e.next = sh.lru.prev, &sh.lru
	sh.lru.prev.next = e
	sh.lru.prev = e
	s.entries.Add(1)
	if !ws.Pinned {
		return true
	}
	p := Pin{
		Endpoint: routing.EndpointKey(strings.Clone(ws.Endpoint)), DPRank: int(ws.Rank),
		DecodeCost: ws.DecodeCost, PrefillCost: ws.PrefillCost, IATFactor: ws.IATFactor,
		At: time.Unix(0, now-int64(ws.PinAgeMillis)*int64(time.Millisecond)),
	}
	e.pin, e.pinned = p, true
	if c := contribution(budget(ws.Total, ws.Processed), p); c > 0 {
		e.contrib = c
		e.work = s.work.add(p.Endpoint, c)
	}
	return true
}
