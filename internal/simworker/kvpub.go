package simworker

import (
	"bytes"
	"context"
	"encoding/binary"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// kvPub sends KV event batches on a ZMQ PUB socket (bound, or dialed)
// from its own goroutine.
type kvPub struct {
	sock   zmq4.Socket
	dialed string // the subscriber's address in dial mode, else ""
	topic  []byte
	log    *slog.Logger
	queue  chan kvMsg
	seq    uint64 // next sequence number (owned by the caller of publish)
	// dropped counts batches dropped because the queue was full.
	dropped atomic.Uint64
	wg      sync.WaitGroup
}

func newKVPub(ctx context.Context, addr string, dial bool, log *slog.Logger) (*kvPub, error) {
	if dial {
		// go-zeromq redials a broken connection itself (retrying every
		// 250 ms until ctx ends); the first dial may wait for the
		// subscriber to bind, so it runs in the background.
		p := &kvPub{sock: zmq4.NewPub(ctx, zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true)),
			dialed: addr, log: log, queue: make(chan kvMsg, 1024)}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			if err := p.sock.Dial(addr); err != nil && ctx.Err() == nil {
				log.Warn("kv events: dial failed", "addr", addr, "err", err)
			}
		}()
		return p, nil
	}
	sock := zmq4.NewPub(ctx)
	if err := sock.Listen(addr); err != nil {
		_ = sock.Close()
		return nil, err
	}
	return &kvPub{sock: sock, log: log, queue: make(chan kvMsg, 1024)}, nil
}

type kvMsg struct {
	seq     uint64
	payload []byte
}

// addr is the bound address as a ZMQ endpoint, e.g. "tcp://127.0.0.1:5557",
// or the dialed one.
func (p *kvPub) addr() string {
	if p.dialed != "" {
		return p.dialed
	}
	return "tcp://" + p.sock.Addr().String()
}

func (p *kvPub) start(topic string) {
	p.topic = []byte(topic)
	p.wg.Add(1)
	go p.run()
}

func (p *kvPub) run() {
	defer p.wg.Done()
	for m := range p.queue {
		var sb [8]byte
		binary.BigEndian.PutUint64(sb[:], m.seq)
		if err := p.sock.Send(zmq4.NewMsgFrom(p.topic, sb[:], m.payload)); err != nil {
			p.log.Debug("kv events: send failed", "err", err)
		}
	}
}

// publish queues one batch; it never blocks. A batch that does not fit is
// dropped but keeps its sequence number, so subscribers see a gap.
func (p *kvPub) publish(events []kvindex.Event) {
	if len(events) == 0 {
		return
	}
	m := kvMsg{seq: p.seq, payload: encodeBatch(float64(time.Now().UnixNano())/1e9, events)}
	p.seq++
	select {
	case p.queue <- m:
	default:
		p.dropped.Add(1)
	}
}

// close stops the sender and closes the socket.
func (p *kvPub) close() {
	close(p.queue)
	p.wg.Wait()
	_ = p.sock.Close()
}

// encodeBatch encodes vLLM's EventBatch in msgspec's array_like form:
// [ts, [events...], data_parallel_rank], each event a tagged array:
// ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, lora_name] or ["BlockRemoved", block_hashes, medium].
func encodeBatch(ts float64, events []kvindex.Event) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	// Writes to a bytes.Buffer cannot fail.
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(ts)
	_ = enc.EncodeArrayLen(len(events))
	for i := range events {
		ev := &events[i]
		switch ev.Kind {
		case kvindex.Stored:
			_ = enc.EncodeArrayLen(8)
			_ = enc.EncodeString("BlockStored")
			_ = enc.EncodeArrayLen(len(ev.Blocks))
			n := 0
			for _, b := range ev.Blocks {
				_ = enc.EncodeUint64(b.EngineHash)
				n += len(b.Tokens)
			}
			if ev.HasParent {
				_ = enc.EncodeUint64(ev.Parent)
			} else {
				_ = enc.EncodeNil()
			}
			_ = enc.EncodeArrayLen(n)
			for _, b := range ev.Blocks {
				for _, t := range b.Tokens {
					_ = enc.EncodeUint32(t)
				}
			}
			_ = enc.EncodeInt(int64(ev.BlockSize))
			_ = enc.EncodeNil() // lora_id
			_ = enc.EncodeString("GPU")
			_ = enc.EncodeNil() // lora_name
		case kvindex.Removed:
			_ = enc.EncodeArrayLen(3)
			_ = enc.EncodeString("BlockRemoved")
			_ = enc.EncodeArrayLen(len(ev.RemovedHashes))
			for _, h := range ev.RemovedHashes {
				_ = enc.EncodeUint64(h)
			}
			_ = enc.EncodeString("GPU")
		}
	}
	_ = enc.EncodeInt(0) // data_parallel_rank
	return buf.Bytes()
}

// copyEvent copies ev's slices, which the worker reuses after its hook
// returns.
func copyEvent(ev kvindex.Event) kvindex.Event {
	ev.RemovedHashes = slices.Clone(ev.RemovedHashes)
	if ev.Blocks != nil {
		blocks := make([]kvindex.StoredBlock, len(ev.Blocks))
		for i, b := range ev.Blocks {
			blocks[i] = kvindex.StoredBlock{EngineHash: b.EngineHash, Tokens: slices.Clone(b.Tokens)}
		}
		ev.Blocks = blocks
	}
	return ev
}
