package sync

import (
	"cmp"
	"errors"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// Message budget: a batch or snapshot is cut before its estimated size
// passes maxBody (the envelope and estimation slack stay under
// wire.MaxMessage); the queue is flushed at once past urgentBytes.
const (
	maxBody     = wire.MaxMessage - 16<<10
	urgentBytes = maxBody * 3 / 4
)

// OnDecision is the engine.Deps.OnDecision hook: it queues the
// decision's Start and records it in the in-flight set. It never blocks.
func (s *Syncer) OnDecision(_ *routing.Request, d *routing.Decision) {
	id := d.Number()
	if id == 0 {
		return
	}
	sh := d.Share()
	if len(sh.Endpoint) > wire.MaxStringLen {
		s.m.dropped.WithLabelValues("too_large").Inc()
		return
	}
	st := &wire.Start{
		ID: id, Endpoint: string(sh.Endpoint), DPRank: int32(sh.DPRank), BlockSize: u32(sh.BlockSize), Blocks: sh.Blocks,
		ISL: u32(sh.ISL), Overlap: u32(sh.Overlap), ExpectedDecodeBlocks: u32(sh.ExpectedDecodeBlocks),
		PrefixID: sh.PrefixID, Tenant: sh.Tenant, Model: string(sh.Model), TTL: u32ms(s.cfg.DecisionTTL),
		TotalRequests: u32(sh.TotalRequests), OSL: uint8(sh.OSL), OSLTokens: u32(sh.OSLTokens), IAT: uint8(sh.IAT),
		MaxTokens:       u32(sh.MaxTokens),
		PrefillEndpoint: string(sh.PrefillEndpoint), PrefillDPRank: i32(sh.PrefillDPRank), PrefillCached: u32(sh.PrefillCached),
	}
	if len(st.Blocks) > wire.MaxBlocks {
		st.Blocks, st.Overlap = st.Blocks[:wire.MaxBlocks], min(st.Overlap, wire.MaxBlocks)
	}
	s.lmu.Lock()
	s.inflight[id] = st
	s.inflightAt[id] = s.clk.Now()
	s.enqueueLocked(wire.StartItem(*st), startSize(st))
	s.lmu.Unlock()
}

// OnFirst is the engine.Deps.OnFirst hook: the decision's first token.
func (s *Syncer) OnFirst(d *routing.Decision) {
	id := d.Number()
	if id == 0 {
		return
	}
	s.lmu.Lock()
	if st, ok := s.inflight[id]; ok {
		st.Prefilled = true
		s.enqueueLocked(wire.FirstItem(id), 12)
	}
	s.lmu.Unlock()
}

// OnDone is the engine.Deps.OnDone hook: it queues the decision's End and
// its Outcome (when it teaches anything) and forgets the decision.
func (s *Syncer) OnDone(d *routing.Decision, o routing.Outcome) {
	id := d.Number()
	if id == 0 {
		return
	}
	ro, teach := d.ShareOutcome(o)
	var out wire.Outcome
	if teach {
		out = wire.Outcome{
			ID: id, Endpoint: string(ro.Endpoint), DPRank: int32(ro.DPRank), Kind: uint8(ro.Kind), Status: u16(ro.Status),
			TTFTMicros: micros(ro.TTFT), LatencyMicros: micros(ro.Latency),
			PromptTokens: i32(ro.PromptTokens), CompletionTokens: i32(ro.CompletionTokens), CachedTokens: i32(ro.CachedTokens),
			PrefixID: ro.PrefixID, Tenant: ro.Tenant, Model: string(ro.Model), Served: string(ro.Served),
			BlockSize: u32(ro.BlockSize), ISL: u32(ro.ISL), Overlap: u32(ro.Overlap),
			QueuedPrefillTokens: uint64(max(ro.QueuedPrefillTokens, 0)), OSL: uint8(ro.OSL),
		}
		teach = len(out.Endpoint) <= wire.MaxStringLen && len(out.Served) <= wire.MaxStringLen
	}
	s.lmu.Lock()
	if _, ok := s.inflight[id]; ok {
		delete(s.inflight, id)
		delete(s.inflightAt, id)
		s.enqueueLocked(wire.EndItem(id), 12)
	}
	if o.Kind == routing.OutcomeSuccess && !o.ServedUnknown && !s.cfg.Claims.Disabled {
		// The worker counted it finished: not one of the peers'.
		s.recordOwnLocked(cmp.Or(o.Served, d.Endpoint), s.clk.Now())
	}
	if teach {
		s.enqueueLocked(wire.OutcomeItem(out), outcomeSize(&out))
	}
	s.lmu.Unlock()
}

// enqueueLocked queues one item (s.lmu held), or drops it when the queue
// is full.
func (s *Syncer) enqueueLocked(it wire.Item, size int) {
	if len(s.queue) >= s.cfg.MaxQueueItems {
		s.m.dropped.WithLabelValues("queue_full").Inc()
		return
	}
	s.queue = append(s.queue, it)
	s.qbytes += size
	if len(s.queue) == 1 {
		s.signal(s.kick)
	}
	if s.qbytes >= urgentBytes || len(s.queue) >= wire.MaxItems {
		s.signal(s.urgent)
	}
}

// maxResnapGap bounds the pause between two re-snapshots (at most a
// quarter of the snapshot interval).
const maxResnapGap = 250 * time.Millisecond

// run is the flusher: batches, heartbeats, snapshots and the peer sweep.
func (s *Syncer) run() {
	defer s.wg.Done()
	hb := time.NewTicker(s.cfg.HeartbeatInterval)
	defer hb.Stop()
	snap := time.NewTicker(s.cfg.SnapshotInterval)
	defer snap.Stop()
	// A tenth of the TTL: a silent peer is dropped at most TTL/10 late.
	sweep := time.NewTicker(min(s.cfg.HeartbeatInterval, s.cfg.PeerTTL/10))
	defer sweep.Stop()
	batch := time.NewTimer(time.Hour)
	batch.Stop()
	var waiting <-chan time.Time // batch.C while a batch waits
	// Re-snapshots (a peer joined, restarted or came back) come at most
	// every gap (a quarter of the snapshot interval, at most
	// maxResnapGap): a flood of forged joins must not make this replica
	// publish without pause.
	gap := min(s.cfg.SnapshotInterval/4, maxResnapGap)
	resnapT := time.NewTimer(time.Hour)
	resnapT.Stop()
	defer resnapT.Stop()
	var resnapWait <-chan time.Time // resnapT.C while a re-snapshot waits
	var lastSnap time.Time
	snapshot := func() {
		s.snapshot()
		lastSnap = time.Now()
	}
	for {
		select {
		case <-s.stop:
			batch.Stop()
			s.flush()
			s.flushKV()
			return
		case <-s.kick:
			if waiting == nil {
				batch.Reset(s.cfg.BatchInterval)
				waiting = batch.C
			}
		case <-waiting:
			waiting = nil
			s.flush()
		case <-s.urgent:
			s.flush()
		case <-s.kvKick:
			s.flushKV()
		case <-hb.C:
			s.heartbeat()
		case <-snap.C:
			snapshot()
		case <-s.resnap:
			if wait := time.Until(lastSnap.Add(gap)); wait > 0 {
				if resnapWait == nil {
					resnapT.Reset(wait)
					resnapWait = resnapT.C
				}
				continue
			}
			snapshot()
		case <-resnapWait:
			resnapWait = nil
			snapshot()
		case <-sweep.C:
			s.sweep()
			s.place()
		}
	}
}

// takeQueue swaps the queue out.
func (s *Syncer) takeQueue() []wire.Item {
	s.lmu.Lock()
	defer s.lmu.Unlock()
	q := s.queue
	s.queue, s.spare = s.spare[:0], nil
	s.qbytes = 0
	return q
}

// flush publishes the queued items as batches of at most maxBody
// estimated bytes and wire.MaxItems items.
func (s *Syncer) flush() { s.publishItems(s.takeQueue()) }

// publishItems publishes items taken from the queue, then recycles q.
func (s *Syncer) publishItems(q []wire.Item) {
	if len(q) == 0 {
		s.recycle(q)
		return
	}
	if !s.connected.Load() {
		s.m.dropped.WithLabelValues("disconnected").Add(float64(len(q)))
		s.recycle(q)
		return
	}
	for start := 0; start < len(q); {
		end, size := start, 0
		for end < len(q) && end-start < wire.MaxItems {
			n := itemSize(&q[end])
			if end > start && size+n > maxBody {
				break
			}
			size += n
			end++
		}
		s.publishBatch(q[start:end])
		start = end
	}
	s.recycle(q)
}

func (s *Syncer) recycle(q []wire.Item) {
	clear(q) // drop references to block keys and strings
	s.lmu.Lock()
	if s.spare == nil && cap(q) <= 4*wire.MaxItems {
		s.spare = q[:0]
	}
	s.lmu.Unlock()
}

func (s *Syncer) publishBatch(items []wire.Item) {
	m := wire.Message{Kind: wire.KindBatch, Batch: items}
	if err := s.publish(&m); errors.Is(err, wire.ErrTooLarge) && len(items) > 1 {
		// The estimate was short (it should not be): halve.
		h := len(items) / 2
		s.publishBatch(items[:h])
		s.publishBatch(items[h:])
		return
	}
	s.m.batchItems.Observe(float64(len(items)))
}

// publish encodes and sends one message, counting it.
func (s *Syncer) publish(m *wire.Message) error {
	m.Pool, m.Replica, m.Epoch = s.cfg.Pool, s.cfg.Replica, s.epoch
	s.seq++
	m.Seq = s.seq
	b, err := wire.Append(s.buf[:0], m)
	if err != nil {
		s.m.dropped.WithLabelValues("too_large").Inc()
		return err
	}
	if cap(b) <= 2*wire.MaxMessage {
		s.buf = b
	}
	if err := s.nc.Publish(s.subjects[m.Kind], b); err != nil {
		s.m.dropped.WithLabelValues("publish_error").Inc()
		return err
	}
	s.m.sent[m.Kind].Inc()
	return nil
}

func (s *Syncer) heartbeat() {
	if !s.connected.Load() {
		return
	}
	s.lmu.Lock()
	n := len(s.inflight)
	s.lmu.Unlock()
	m := wire.Message{Kind: wire.KindHeartbeat, Heartbeat: wire.Heartbeat{InFlight: u32(n), Interval: u32ms(s.cfg.HeartbeatInterval)}}
	_ = s.publish(&m)
}

// snapshot publishes the in-flight set, after the queued items (so that
// peers see every Start and End before the snapshot that follows them).
// Block keys are left out of the starts that do not fit in one message,
// and starts past the message's bound are left out (counted).
func (s *Syncer) snapshot() {
	if !s.connected.Load() {
		return
	}
	s.lmu.Lock()
	q := s.queue
	s.queue, s.spare = s.spare[:0], nil
	s.qbytes = 0
	starts := make([]wire.Start, 0, len(s.inflight))
	for _, st := range s.inflight {
		starts = append(starts, *st)
	}
	s.lmu.Unlock()
	// The items queued before the copy go first; the ones queued since
	// follow the snapshot.
	s.publishItems(q)
	budget := maxBody
	for i := range starts {
		budget -= startSize(&starts[i]) - 8*len(starts[i].Blocks)
	}
	keep := len(starts)
	if budget < 0 || keep > wire.MaxSnapshotStarts {
		// Even without block keys they do not fit: leave starts out.
		keep, budget = 0, maxBody
		for keep < len(starts) && keep < wire.MaxSnapshotStarts {
			n := startSize(&starts[keep]) - 8*len(starts[keep].Blocks)
			if n > budget {
				break
			}
			budget -= n
			keep++
		}
		s.m.dropped.WithLabelValues("snapshot_trimmed").Add(float64(len(starts) - keep))
		starts = starts[:keep]
		budget = 0
	}
	for i := range starts {
		if n := 8 * len(starts[i].Blocks); n > budget {
			starts[i].Blocks, starts[i].Overlap = nil, 0
		} else {
			budget -= n
		}
	}
	m := wire.Message{Kind: wire.KindSnapshot, Snapshot: starts}
	_ = s.publish(&m)
}

// Size estimates (upper bounds) of encoded items.
func startSize(st *wire.Start) int {
	n := 80 + len(st.Endpoint) + len(st.PrefixID) + len(st.Tenant) + len(st.Model) + 8*len(st.Blocks)
	if st.PrefillEndpoint != "" {
		n += 16 + len(st.PrefillEndpoint) // its length, rank and cached tokens
	}
	return n
}

func outcomeSize(o *wire.Outcome) int {
	return 96 + len(o.Endpoint) + len(o.PrefixID) + len(o.Tenant) + len(o.Model) + len(o.Served)
}

func itemSize(it *wire.Item) int {
	switch it.Kind {
	case wire.ItemStart:
		return startSize(&it.Start)
	case wire.ItemOutcome:
		return outcomeSize(&it.Outcome)
	}
	return 12
}

func u32(n int) uint32 { return uint32(min(max(n, 0), math.MaxUint32)) }
func u16(n int) uint16 { return uint16(min(max(n, 0), math.MaxUint16)) }
func i32(n int) int32  { return int32(min(max(n, math.MinInt32), math.MaxInt32)) }

func u32ms(d time.Duration) uint32  { return u32(int(d / time.Millisecond)) }
func micros(d time.Duration) uint32 { return u32(int(d / time.Microsecond)) }
