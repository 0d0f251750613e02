package sync

import (
	"errors"
	"log/slog"
	"slices"
	"sort"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// peer is one peer replica as this replica knows it (guarded by s.rmu).
type peer struct {
	replica   string
	epoch     uint64
	seq       uint64
	gaps      uint64    // messages missed (sequence gaps)
	lastHeard time.Time // on this replica's clock
	lastHB    time.Time
	reported  uint32 // in-flight count of its last heartbeat
	interval  uint32
	decisions map[uint64]*remote
	// joined and msgs tell an established peer from a newcomer
	// (established).
	joined time.Time
	msgs   uint64
	// trust bounds what it may claim (trust.go).
	trust peerTrust
	// candEpoch is another epoch heard since the current one was last
	// heard, first at candSince (takeEpoch); 0: none.
	candEpoch uint64
	candSince time.Time
}

// Peers become established after establishMsgs messages over at least a
// heartbeat interval, and stay so while they are heard as a live replica
// is, at least every two heartbeat intervals: a real replica after its
// third heartbeat, while an id that sent one message, or one re-heard
// only every few intervals (forged ids taking turns), stays a newcomer.
const establishMsgs = 3

// established reports whether p has been heard long enough, and recently
// enough, to keep its slot when the slots are full (evictNewcomer) and to
// take a turn in bursts (turns.go).
func (p *peer) established(now time.Time, hb time.Duration) bool {
	return p.msgs >= establishMsgs && now.Sub(p.joined) >= hb && now.Sub(p.lastHeard) <= 2*hb
}

// remote is one applied peer decision.
type remote struct {
	rd       *engine.RemoteDecision
	deadline time.Time // the Start's TTL, at most Config.MaxRemoteTTL
	// applied is when it was applied here; endpoint, rank and isl are
	// its Start's (trust.go, vouch.go).
	applied   time.Time
	endpoint  routing.EndpointKey
	rank      int32
	isl       int64
	prefilled bool // its first token came
	learned   bool // its outcome was learnt
	vouched   bool // a fresh scrape of its endpoint counted it (vouch.go)
}

// endAll ends every decision of the peer (it restarted, left or was
// quarantined); their outcomes will not be learnt.
func (p *peer) endAll() {
	for id, r := range p.decisions {
		r.rd.End()
		delete(p.decisions, id)
	}
	p.trust.prefill = 0
}

// end ends one decision, kept for its outcome.
func (p *peer) end(id uint64, now time.Time) {
	if r, ok := p.decisions[id]; ok {
		p.release(id, r, now, false, false)
	}
}

// receive is the subscription's handler: NATS calls it on one goroutine,
// in order.
func (s *Syncer) receive(msg *nats.Msg) {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	if s.closed {
		return
	}
	m, err := s.dec.Decode(msg.Data)
	if err != nil {
		s.m.received[0].Inc()
		s.m.dropped.WithLabelValues("malformed").Inc()
		return
	}
	if m.Replica == s.cfg.Replica {
		if m.Epoch != s.epoch {
			// Another process uses this replica id: its decisions would be
			// taken for a restart of ours at every message. Ignore it.
			s.m.dropped.WithLabelValues("own_replica_id").Inc()
			if s.authLog.allow("dup-replica", time.Now()) {
				s.log.Error("another replica of the pool uses this replica id: its messages are ignored; give every replica its own --replica-id")
			}
		}
		return
	}
	if int(m.Kind) >= len(s.m.received) {
		// A warm-start message (warm.go) has its own subjects.
		s.m.received[0].Inc()
		s.m.dropped.WithLabelValues("unexpected_kind").Inc()
		return
	}
	s.m.received[m.Kind].Inc()
	if m.Pool != s.cfg.Pool {
		s.m.dropped.WithLabelValues("other_pool").Inc()
		return
	}
	now := s.clk.Now()
	p := s.peers[m.Replica]
	if p == nil {
		heard := s.seen.hear(m.Replica, now)
		if len(s.peers) >= s.cfg.MaxPeers && !s.evictNewcomer(now, heard) {
			s.m.dropped.WithLabelValues("too_many_peers").Inc()
			return
		}
		s.seen.forget(m.Replica)
		p = &peer{replica: m.Replica, epoch: m.Epoch, decisions: make(map[uint64]*remote), joined: now, msgs: heard - 1}
		s.peers[m.Replica] = p
		s.peerLine(now, slog.LevelInfo, "peer replica joined", "peer", m.Replica)
		s.signal(s.resnap) // it may have missed our state
	} else if p.epoch != m.Epoch {
		if !s.takeEpoch(p, m.Epoch, now) {
			s.m.dropped.WithLabelValues("epoch_conflict").Inc()
			return
		}
		s.peerLine(now, slog.LevelInfo, "peer replica restarted: its previous decisions end", "peer", m.Replica, "ended", len(p.decisions))
		p.endAll()
		p.trust.ended, p.trust.order, p.trust.next = nil, nil, 0
		p.epoch, p.seq, p.gaps = m.Epoch, 0, 0
		s.signal(s.resnap)
	} else if now.Sub(p.lastHeard) > 2*s.cfg.HeartbeatInterval {
		// Silent for a while (its connection or ours was down): it may
		// have missed our messages too.
		s.signal(s.resnap)
	}
	p.candEpoch = 0 // the current epoch is alive
	if p.seq != 0 && m.Seq > p.seq+1 {
		p.gaps += m.Seq - p.seq - 1
	}
	p.seq = m.Seq
	p.lastHeard = now
	p.msgs++
	switch m.Kind {
	case wire.KindBatch:
		for i := range m.Batch {
			s.applyItem(p, &m.Batch[i], now)
		}
	case wire.KindSnapshot:
		s.applySnapshot(p, m.Snapshot, now)
	case wire.KindHeartbeat:
		p.lastHB, p.reported, p.interval = now, m.Heartbeat.InFlight, m.Heartbeat.Interval
	case wire.KindKVEvents:
		s.receiveKV(&m.KVEvents)
	}
}

// evictNewcomer frees a peer slot for a new id heard heard times (with
// this message) when the slots are full: it forgets the newcomer (not
// established) heard the fewest times, the longest ago among equals,
// ending its decisions, if that newcomer was heard fewer times than the
// new id. Ids that each send a message or two (300 forged ids at 250
// messages a second kept all 256 slots full before this) cannot keep a
// real replica out: its heartbeats, counted while it waits
// (Syncer.seen), soon outnumber theirs, and once established it is never
// evicted. It reports false when no slot can be freed.
func (s *Syncer) evictNewcomer(now time.Time, heard uint64) bool {
	var victim *peer
	for _, p := range s.peers {
		if p.established(now, s.cfg.HeartbeatInterval) {
			continue
		}
		if victim == nil || p.msgs < victim.msgs || (p.msgs == victim.msgs && p.lastHeard.Before(victim.lastHeard)) {
			victim = p
		}
	}
	if victim == nil || victim.msgs >= heard {
		return false
	}
	s.forgetPeer(victim)
	delete(s.peers, victim.replica)
	s.seen.put(victim.replica, victim.msgs, victim.lastHeard)
	s.m.dropped.WithLabelValues("peer_evicted").Inc()
	return true
}

func (s *Syncer) applyItem(p *peer, it *wire.Item, now time.Time) {
	switch it.Kind {
	case wire.ItemStart:
		s.start(p, &it.Start, now)
	case wire.ItemFirst:
		if r, ok := p.decisions[it.ID]; ok {
			p.setPrefilled(r)
		}
	case wire.ItemEnd:
		p.end(it.ID, now)
	case wire.ItemOutcome:
		s.learn(p, &it.Outcome, now)
	}
}

// start applies one peer decision unless it is already applied.
func (s *Syncer) start(p *peer, st *wire.Start, now time.Time) {
	if r, ok := p.decisions[st.ID]; ok {
		if st.Prefilled {
			p.setPrefilled(r)
		}
		return
	}
	switch {
	case st.TTL == 0:
		s.m.rejected.WithLabelValues("no_ttl").Inc()
		return
	case int64(st.ISL) > int64(s.cfg.MaxRemoteTokens):
		s.m.rejected.WithLabelValues("too_many_tokens").Inc()
		return
	}
	if reason := s.admit(p, st, now); reason != "" {
		s.m.rejected.WithLabelValues(reason).Inc()
		return
	}
	rs := routing.RemoteStart{
		Endpoint: routing.EndpointKey(st.Endpoint), DPRank: int(st.DPRank), BlockSize: int(st.BlockSize),
		ISL: int(st.ISL), Overlap: int(st.Overlap), ExpectedDecodeBlocks: int(st.ExpectedDecodeBlocks),
		Model: routing.ModelName(st.Model), PrefixID: st.PrefixID, Tenant: st.Tenant,
		TotalRequests: int(st.TotalRequests), OSL: routing.Level(st.OSL), OSLTokens: int(st.OSLTokens),
		IAT: routing.Level(st.IAT), MaxTokens: int(st.MaxTokens),
		PrefillEndpoint: routing.EndpointKey(st.PrefillEndpoint), PrefillDPRank: int(st.PrefillDPRank), PrefillCached: int(st.PrefillCached),
	}
	if len(st.Blocks) > 0 {
		// The decoded keys share one array per message: copy them, so
		// that a retained decision pins only its own keys.
		rs.Blocks = slices.Clone(st.Blocks)
	}
	rd, err := s.eng.StartRemote(rs)
	if err != nil {
		s.reject(err)
		return
	}
	r := &remote{rd: rd, deadline: now.Add(min(time.Duration(st.TTL)*time.Millisecond, s.cfg.MaxRemoteTTL))}
	p.applied(st.ID, st, r, now)
}

// applySnapshot makes the peer's applied decisions those of the snapshot:
// unknown ones start, missing ones end, known ones stay as they are.
func (s *Syncer) applySnapshot(p *peer, starts []wire.Start, now time.Time) {
	in := make(map[uint64]struct{}, len(starts))
	for i := range starts {
		in[starts[i].ID] = struct{}{}
	}
	for id := range p.decisions {
		if _, ok := in[id]; !ok {
			p.end(id, now)
			s.m.repaired.WithLabelValues("ended").Inc()
		}
	}
	for i := range starts {
		if _, ok := p.decisions[starts[i].ID]; !ok {
			s.start(p, &starts[i], now)
			if _, ok := p.decisions[starts[i].ID]; ok {
				s.m.repaired.WithLabelValues("started").Inc()
			}
		} else if starts[i].Prefilled {
			p.setPrefilled(p.decisions[starts[i].ID])
		}
	}
}

func (s *Syncer) reject(err error) {
	reason := "invalid"
	switch {
	case errors.Is(err, routing.ErrUnknownEndpoint):
		reason = "unknown_endpoint"
	case errors.Is(err, routing.ErrRemoteLimit):
		reason = "limit"
	}
	s.m.rejected.WithLabelValues(reason).Inc()
}

func remoteOutcome(o *wire.Outcome) routing.RemoteOutcome {
	return routing.RemoteOutcome{
		Endpoint: routing.EndpointKey(o.Endpoint), DPRank: int(o.DPRank),
		Outcome: routing.Outcome{
			Kind: routing.OutcomeKind(o.Kind), Served: routing.EndpointKey(o.Served), Status: int(o.Status),
			TTFT: time.Duration(o.TTFTMicros) * time.Microsecond, Latency: time.Duration(o.LatencyMicros) * time.Microsecond,
			PromptTokens: int(o.PromptTokens), CompletionTokens: int(o.CompletionTokens), CachedTokens: int(o.CachedTokens),
		},
		BlockSize: int(o.BlockSize), ISL: int(o.ISL), Overlap: int(o.Overlap),
		QueuedPrefillTokens: int64(min(o.QueuedPrefillTokens, 1<<62)), OSL: routing.Level(o.OSL),
		PrefixID: o.PrefixID, Tenant: o.Tenant, Model: routing.ModelName(o.Model),
	}
}

// sweep forgets peers silent for PeerTTL (ending their decisions) and
// ends decisions past their TTL.
func (s *Syncer) sweep() {
	now := s.clk.Now()
	fresh := s.freshLoads(now) // before s.rmu: it takes s.lmu
	s.rmu.Lock()
	defer s.rmu.Unlock()
	if s.closed {
		return
	}
	for id, p := range s.peers {
		if now.Sub(p.lastHeard) > s.cfg.PeerTTL {
			s.peerLine(now, slog.LevelWarn, "peer replica silent: its decisions end", "peer", id, "silent", now.Sub(p.lastHeard).Round(time.Millisecond), "ended", len(p.decisions))
			s.m.expired.Add(float64(len(p.decisions)))
			s.forgetPeer(p)
			delete(s.peers, id)
			continue
		}
		for did, r := range p.decisions {
			if now.After(r.deadline) {
				p.end(did, now)
				s.m.expired.Inc()
			} else if r.rd.Ended() {
				p.release(did, r, now, false, true) // the engine's stale timer ended it
			}
		}
		p.trust.pruneEnded(now, 2*s.cfg.OutcomeSlack+s.cfg.BatchInterval, s.cfg.MaxRemoteTTL)
	}
	s.checkClaims(fresh, now)
	s.expirePending(now)
}

// takeEpoch reports whether a message of peer p's id with another epoch
// is its restart. It is when that epoch alone has been heard for two
// heartbeat intervals (a live peer sends at least one heartbeat per
// interval): a restarted process's old epoch falls silent, while a client
// that sends messages with a live peer's id and other epochs (each one a
// "restart" that ended the peer's decisions) is dropped, whether it
// alternates epochs (the candidate changes at every message) or keeps
// one (the live peer's own messages keep resetting it). Messages of the
// candidate epoch are dropped until it is taken; its snapshot repairs
// what they carried.
func (s *Syncer) takeEpoch(p *peer, epoch uint64, now time.Time) bool {
	if p.candEpoch != epoch {
		p.candEpoch, p.candSince = epoch, now
		return false
	}
	takeover := 2 * s.cfg.HeartbeatInterval
	if now.Sub(p.candSince) < takeover || now.Sub(p.lastHeard) < takeover {
		return false
	}
	p.candEpoch = 0
	return true
}

// PeerInfo describes one peer replica (/debug/replicas).
type PeerInfo struct {
	Replica string `json:"replica"`
	Epoch   uint64 `json:"epoch"`
	// LastHeardSeconds and LastHeartbeatSeconds are ages on this
	// replica's clock (-1: no heartbeat yet).
	LastHeardSeconds     float64 `json:"last_heard_seconds"`
	LastHeartbeatSeconds float64 `json:"last_heartbeat_seconds"`
	// InFlightReported is the in-flight count of its last heartbeat,
	// InFlightApplied its decisions applied here; Lag is their
	// difference (what this replica has not applied).
	InFlightReported int `json:"inflight_reported"`
	InFlightApplied  int `json:"inflight_applied"`
	Lag              int `json:"lag"`
	// Seq is its last message's number, MissedMessages the gaps seen.
	Seq            uint64 `json:"seq"`
	MissedMessages uint64 `json:"missed_messages"`
	// PrefillTokens is the prompt tokens of its applied decisions not
	// prefilled yet; Quarantined says its claims were refuted again and
	// again (its Starts and outcomes are refused for now).
	PrefillTokens int64 `json:"prefill_tokens"`
	Quarantined   bool  `json:"quarantined,omitempty"`
}

// Status is the syncer's state (/debug/replicas).
type Status struct {
	Replica   string     `json:"replica"`
	Pool      string     `json:"pool"`
	Epoch     uint64     `json:"epoch"`
	Subject   string     `json:"subject"`
	Connected bool       `json:"connected"`
	Server    string     `json:"server,omitempty"`
	InFlight  int        `json:"inflight"`
	Peers     []PeerInfo `json:"peers"`
}

// Status returns the syncer's state and its peers, sorted by replica id.
func (s *Syncer) Status() Status {
	st := Status{Replica: s.cfg.Replica, Pool: s.cfg.Pool, Epoch: s.epoch, Subject: s.cfg.SubjectPrefix, Connected: s.connected.Load(), Peers: []PeerInfo{}}
	if st.Connected && s.nc != nil {
		st.Server = s.nc.ConnectedUrlRedacted()
	}
	s.lmu.Lock()
	st.InFlight = len(s.inflight)
	s.lmu.Unlock()
	now := s.clk.Now()
	s.rmu.Lock()
	for _, p := range s.peers {
		pi := PeerInfo{
			Replica: p.replica, Epoch: p.epoch, LastHeardSeconds: now.Sub(p.lastHeard).Seconds(), LastHeartbeatSeconds: -1,
			InFlightReported: int(p.reported), InFlightApplied: len(p.decisions), Seq: p.seq, MissedMessages: p.gaps,
			PrefillTokens: p.trust.prefill, Quarantined: s.quarantined(p.replica, now),
		}
		if !p.lastHB.IsZero() {
			pi.LastHeartbeatSeconds = now.Sub(p.lastHB).Seconds()
		}
		pi.Lag = pi.InFlightReported - pi.InFlightApplied
		st.Peers = append(st.Peers, pi)
	}
	s.rmu.Unlock()
	sort.Slice(st.Peers, func(i, j int) bool { return st.Peers[i].Replica < st.Peers[j].Replica })
	return st
}

// newestUpdateAge is the age of the newest peer message, in seconds; 0
// without peers.
func (s *Syncer) newestUpdateAge() float64 {
	now := s.clk.Now()
	s.rmu.Lock()
	defer s.rmu.Unlock()
	var newest time.Time
	for _, p := range s.peers {
		if p.lastHeard.After(newest) {
			newest = p.lastHeard
		}
	}
	if newest.IsZero() {
		return 0
	}
	return now.Sub(newest).Seconds()
}

func (s *Syncer) peerCount() float64 {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	return float64(len(s.peers))
}
