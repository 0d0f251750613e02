package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// KV transfer defaults (Transfer's zero fields). They are assumptions, not
// measurements: DefaultKVBytesPerToken is Llama-3.1-8B's KV size in fp16
// from its architecture (32 layers × 8 KV heads × head dim 128 × K and V ×
// 2 bytes = 131072 bytes, so a 64-token block is 8 MiB);
// DefaultTransferBytesPerSec is half the line rate of a 400 Gb/s RDMA NIC
// (50 GB/s), the kind of link NIXL's RDMA backend (UCX) runs on;
// DefaultTransferLatency is the fixed cost of one transfer (the sidecar's
// extra request, the connector's handshake and completion notice).
const (
	DefaultKVBytesPerToken     = 131072
	DefaultTransferBytesPerSec = 25e9
	DefaultTransferLatency     = time.Millisecond
)

// maxTransferLatency bounds Transfer.Latency.
const maxTransferLatency = time.Minute

// Transfer prices moving a disaggregated request's KV cache from its
// prefill worker to its decode worker: Latency per transfer plus the bytes
// of the blocks the decode worker does not hold yet over BytesPerSec.
type Transfer struct {
	Latency       time.Duration // default DefaultTransferLatency
	BytesPerSec   float64       // default DefaultTransferBytesPerSec
	BytesPerToken int           // default DefaultKVBytesPerToken
}

func (t Transfer) validate() error {
	switch {
	case t.Latency < 0 || t.Latency > maxTransferLatency:
		return fmt.Errorf("%w: transfer latency %v (want 0 to %v)", ErrWorkerConfig, t.Latency, maxTransferLatency)
	case t.BytesPerSec < 0 || math.IsNaN(t.BytesPerSec) || math.IsInf(t.BytesPerSec, 0):
		return fmt.Errorf("%w: transfer bandwidth %v bytes/s (want > 0)", ErrWorkerConfig, t.BytesPerSec)
	case t.BytesPerToken < 0 || t.BytesPerToken > 1<<30:
		return fmt.Errorf("%w: KV bytes per token %d (want 1 to 2^30)", ErrWorkerConfig, t.BytesPerToken)
	}
	return nil
}

func (t Transfer) withDefaults() Transfer {
	if t.Latency == 0 {
		t.Latency = DefaultTransferLatency
	}
	if t.BytesPerSec == 0 {
		t.BytesPerSec = DefaultTransferBytesPerSec
	}
	if t.BytesPerToken == 0 {
		t.BytesPerToken = DefaultKVBytesPerToken
	}
	return t
}

// Time is the transfer time of blocks blocks of blockSize tokens.
func (t Transfer) Time(blocks, blockSize int) time.Duration {
	bytes := float64(blocks) * float64(blockSize) * float64(t.BytesPerToken)
	return t.Latency + time.Duration(math.Round(bytes/t.BytesPerSec*1e9))
}

// transferEvent is the worker field of a KV transfer's landing in the
// event heap (its gen is the request's index).
const transferEvent = -1

// handoff ends a's prefill leg at now (its prefill worker has released it):
// the prompt's blocks the decode worker does not hold are sent, and the
// request lands on the decode worker when the transfer completes. The
// prefill worker's load stays on the decision until the first token.
func (s *simulation) handoff(a *active, now time.Duration) {
	d := s.workers[a.decodeOn]
	bs := d.cfg.BlockSize
	keys := kvindex.AppendBlockKeys(make([]uint64, 0, len(a.req.Tokens)/bs), a.req.Tokens, bs, kvindex.BaseSeed)
	blocks := (a.prompt+bs-1)/bs - d.cache.prefix(keys)
	dt := s.transfer.Time(blocks, bs)
	rr := &s.res.Requests[a.idx]
	rr.TransferBlocks, rr.Transfer = blocks, dt
	s.open[a.idx] = &active{idx: a.idx, req: a.req, dec: a.dec, keys: keys, transferred: true, decodeOn: a.decodeOn, prefillOnly: false}
	s.events.push(stepEvent{at: now + dt, worker: transferEvent, gen: uint64(a.idx)})
	s.note(a, "handoff")
}

// land queues request i, whose KV transfer completed, on its decode
// worker.
func (s *simulation) land(i int) {
	a := s.open[i]
	if a == nil {
		return
	}
	s.after(a.decodeOn, s.workers[a.decodeOn].enqueue(a, s.now))
	s.note(a, "land")
}

// note calls the test observer, if any.
func (s *simulation) note(a *active, step string) {
	if s.observe != nil {
		s.observe(s, a, step)
	}
}
