package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbandit/kvbandit/internal/simworker"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// The simulated fleet: one model, 16-token blocks.
const (
	model     = "sim-model"
	blockSize = 16
	kvBlocks  = 4096
)

// kvMode is how an endpoint's KV events reach kvbandit.
type kvMode int

const (
	// kvConnect: the worker binds its PUB socket, kvbandit connects (vLLM).
	kvConnect kvMode = iota
	// kvBind: kvbandit binds, the worker connects (kv_events_bind,
	// llm-d-inference-sim).
	kvBind
	// kvFlood: kvbandit binds, and the soak's flooding publisher connects
	// in place of the worker (whose simulated model sends no events).
	kvFlood
)

func (m kvMode) String() string {
	return [...]string{"connect", "bind", "flood"}[m]
}

// fleetWorker is one endpoint: a simulated worker on fixed addresses, so
// that a restarted worker comes back where discovery says it is.
type fleetWorker struct {
	idx      int
	httpAddr string // ip:port
	kvAddr   string // tcp://ip:port
	mode     kvMode
	speed    float64

	mu  sync.Mutex
	srv *simworker.Server // nil while down
}

func (w *fleetWorker) name() string { return fmt.Sprintf("w%d/%s", w.idx, w.mode) }

// start runs the worker on its addresses, retrying for a few seconds while
// its ports are still held by the previous instance.
func (w *fleetWorker) start(ctx context.Context, speedUp float64) error {
	cfg := simworker.Config{
		Model: model, Addr: w.httpAddr, Speed: w.speed, SpeedUp: speedUp, DefaultMaxTokens: 32,
		Worker: sim.WorkerConfig{KVBlocks: kvBlocks, BlockSize: blockSize},
	}
	switch w.mode {
	case kvConnect:
		cfg.KVEventsAddr = w.kvAddr
	case kvBind:
		cfg.KVEventsAddr, cfg.KVEventsDial = w.kvAddr, true
	}
	var err error
	for try := 0; try < 50; try++ {
		var s *simworker.Server
		s, err = simworker.New(cfg)
		if err != nil {
			return err
		}
		if err = s.Start(ctx); err == nil {
			w.mu.Lock()
			w.srv = s
			w.mu.Unlock()
			return nil
		}
		s.Close()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("worker %s: %w", w.name(), err)
}

// stop closes the worker (its open requests fail, as when a pod dies).
func (w *fleetWorker) stop() {
	w.mu.Lock()
	s := w.srv
	w.srv = nil
	w.mu.Unlock()
	if s != nil {
		s.Close()
	}
}

func (w *fleetWorker) up() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.srv != nil
}

// fleet is every worker and the endpoints file that describes them.
type fleet struct {
	workers   []*fleetWorker
	file      string
	speedUp   float64
	gen       atomic.Int64 // endpoints file generation
	restarts  atomic.Int64
	restartMu sync.Mutex // one restart at a time; also held while restoring
}

// newFleet lays out n workers (the last `bind` of them in bind mode) plus
// the flood endpoint, on addresses free now.
func newFleet(n, bind int, speedUp float64, file string) (*fleet, error) {
	addrs, err := freeAddrs(2 * (n + 1))
	if err != nil {
		return nil, err
	}
	speeds := []float64{1, 1, 0.7, 1.3, 1, 0.85}
	f := &fleet{file: file, speedUp: speedUp}
	for i := range n + 1 {
		w := &fleetWorker{idx: i, httpAddr: addrs[2*i], kvAddr: "tcp://" + addrs[2*i+1], speed: speeds[i%len(speeds)]}
		switch {
		case i == n:
			w.mode = kvFlood
		case i >= n-bind:
			w.mode = kvBind
		}
		f.workers = append(f.workers, w)
	}
	return f, nil
}

func (f *fleet) start(ctx context.Context) error {
	for _, w := range f.workers {
		if err := w.start(ctx, f.speedUp); err != nil {
			return err
		}
	}
	return nil
}

func (f *fleet) stop() {
	for _, w := range f.workers {
		w.stop()
	}
}

// httpAddrs are every worker's HTTP address (envoysim's cluster).
func (f *fleet) httpAddrs() []string {
	out := make([]string, len(f.workers))
	for i, w := range f.workers {
		out[i] = w.httpAddr
	}
	return out
}

// boundKV are the addresses kvbandit binds for KV events (bind and flood
// modes): the hostile ZMTP peers' targets.
func (f *fleet) boundKV() []string {
	var out []string
	for _, w := range f.workers {
		if w.mode != kvConnect {
			out = append(out, w.kvAddr)
		}
	}
	return out
}

func (f *fleet) flood() *fleetWorker { return f.workers[len(f.workers)-1] }

// record is one endpoints-file entry (routing/discovery's record schema).
type record struct {
	Address      string            `json:"address"`
	Models       []string          `json:"models,omitempty"`
	Engine       string            `json:"engine,omitempty"`
	BlockSize    int               `json:"block_size,omitempty"`
	Weight       float64           `json:"weight,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	KVEvents     string            `json:"kv_events,omitempty"`
	KVEventsBind bool              `json:"kv_events_bind,omitempty"`
}

func (w *fleetWorker) record(gen int64, rng *rand.Rand) record {
	r := record{Address: w.httpAddr, Models: []string{model}, Engine: "vllm", BlockSize: blockSize,
		KVEvents: w.kvAddr, KVEventsBind: w.mode != kvConnect,
		Labels: map[string]string{"worker": fmt.Sprint(w.idx), "mode": w.mode.String()}}
	if rng != nil {
		// Metadata that changes from one generation to the next.
		r.Labels["generation"] = fmt.Sprint(gen)
		r.Labels["zone"] = []string{"a", "b", "c"}[rng.IntN(3)]
		r.Weight = []float64{0, 1, 2, 0.5}[rng.IntN(4)]
		if rng.IntN(10) == 0 {
			r.Models = []string{model, "sim-model-lora"}
		}
	}
	return r
}

// writeAll writes the endpoints file with every worker and no churn.
func (f *fleet) writeAll() error {
	gen := f.gen.Add(1)
	var recs []any
	for _, w := range f.workers {
		recs = append(recs, w.record(gen, nil))
	}
	return f.write(recs)
}

// churn writes a new generation: each worker is present with probability
// 0.8 (at least 3 are), metadata changes, and now and then records that
// discovery must skip.
func (f *fleet) churn(rng *rand.Rand) (present int, err error) {
	gen := f.gen.Add(1)
	keep := make([]bool, len(f.workers))
	for i := range keep {
		keep[i] = rng.Float64() < 0.8
	}
	for n := count(keep); n < 3; n = count(keep) {
		keep[rng.IntN(len(keep))] = true
	}
	var recs []any
	for i, w := range f.workers {
		if keep[i] {
			recs = append(recs, w.record(gen, rng))
		}
	}
	if rng.IntN(5) == 0 {
		// Records discovery must skip (an accepted record would be an
		// endpoint nobody serves on, failing normal traffic).
		bad := []any{
			map[string]any{"address": "not-an-address"},
			map[string]any{"address": "127.0.0.1:1", "engine": "tensorrt"},
			map[string]any{"address": "127.0.0.1:2", "block_size": -16},
			map[string]any{"address": "127.0.0.1:3", "data_parallel_size": 1 << 30},
			map[string]any{"address": "127.0.0.1:4", "models": []string{strings.Repeat("m", 600)}},
			map[string]any{"address": "127.0.0.1:5", "labels": manyLabels(300)},
			"just a string",
		}
		recs = append(recs, bad[rng.IntN(len(bad))])
		if len(recs) > 1 && rng.IntN(2) == 0 {
			recs = append(recs, recs[0]) // a duplicate address
		}
	}
	rng.Shuffle(len(recs), func(i, j int) { recs[i], recs[j] = recs[j], recs[i] })
	return count(keep), f.write(recs)
}

func manyLabels(n int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		m[fmt.Sprintf("label-%d", i)] = "v"
	}
	return m
}

func count(b []bool) int {
	n := 0
	for _, v := range b {
		if v {
			n++
		}
	}
	return n
}

// write replaces the endpoints file atomically (kvbandit polls it).
func (f *fleet) write(recs []any) error {
	b, err := json.MarshalIndent(map[string]any{"endpoints": recs}, "", " ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(f.file), ".endpoints.tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, f.file)
}

// restartOne kills a random worker and starts it again on the same
// addresses after a pause.
func (f *fleet) restartOne(ctx context.Context, rng *rand.Rand) error {
	f.restartMu.Lock()
	defer f.restartMu.Unlock()
	w := f.workers[rng.IntN(len(f.workers))]
	w.stop()
	select {
	case <-ctx.Done():
	case <-time.After(time.Duration(500+rng.IntN(2500)) * time.Millisecond):
	}
	f.restarts.Add(1)
	// Started with a background context: a restarted worker outlives the
	// load (it is stopped with the fleet).
	return w.start(context.Background(), f.speedUp)
}

// restoreAll brings every worker up and writes the full endpoints file.
func (f *fleet) restoreAll() error {
	f.restartMu.Lock()
	defer f.restartMu.Unlock()
	for _, w := range f.workers {
		if !w.up() {
			if err := w.start(context.Background(), f.speedUp); err != nil {
				return err
			}
		}
	}
	return f.writeAll()
}

// ---- the KV-event flood -----------------------------------------------------------

// flooder publishes valid KV events (vLLM's msgspec array_like
// EventBatch) at a fixed rate to the flood endpoint's bound SUB socket,
// connecting again whenever the connection breaks (discovery churn makes
// kvbandit close and reopen that socket).
type flooder struct {
	endpoint string // tcp://ip:port kvbandit binds
	topic    []byte
	rate     float64
	rng      *rand.Rand
	t        *tally

	seq    uint64
	parent uint64 // last stored block hash (0: none)
	hashes []uint64
}

func (fl *flooder) run(ctx context.Context, dialTimeout time.Duration) {
	if fl.rate <= 0 {
		return
	}
	interval := time.Duration(float64(time.Second) / fl.rate)
	tick := time.NewTicker(max(interval, time.Millisecond))
	defer tick.Stop()
	var peer *zmtpPeer
	defer func() {
		if peer != nil {
			peer.Close()
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if peer == nil {
			p, err := dialZMTP(ctx, fl.endpoint, "PUB", dialTimeout)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if err == errRefused {
					fl.t.skip("socket closed (endpoint churned out)")
				} else {
					fl.t.fail("connect: " + err.Error())
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(250 * time.Millisecond):
				}
				continue
			}
			peer = p
		}
		var sb [8]byte
		binary.BigEndian.PutUint64(sb[:], fl.seq)
		if err := peer.send(5*time.Second, fl.topic, sb[:], fl.batch()); err != nil {
			peer.Close()
			peer = nil
			if ctx.Err() == nil {
				fl.t.skip("connection lost (endpoint churned out)")
			}
			continue
		}
		fl.seq++
		fl.t.ok()
	}
}

// batch encodes the next EventBatch: mostly BlockStored chains of 1-8
// blocks of random tokens, sometimes BlockRemoved of earlier blocks.
func (fl *flooder) batch() []byte {
	var buf []byte
	enc := msgpack.NewEncoder(writerFunc(func(p []byte) (int, error) { buf = append(buf, p...); return len(p), nil }))
	_ = enc.EncodeArrayLen(3)
	_ = enc.EncodeFloat64(float64(time.Now().UnixNano()) / 1e9)
	_ = enc.EncodeArrayLen(1)
	if len(fl.hashes) > 64 && fl.rng.IntN(4) == 0 {
		n := 1 + fl.rng.IntN(16)
		_ = enc.EncodeArrayLen(3)
		_ = enc.EncodeString("BlockRemoved")
		_ = enc.EncodeArrayLen(n)
		for range n {
			i := fl.rng.IntN(len(fl.hashes))
			_ = enc.EncodeUint64(fl.hashes[i])
			fl.hashes[i] = fl.hashes[len(fl.hashes)-1]
			fl.hashes = fl.hashes[:len(fl.hashes)-1]
		}
		_ = enc.EncodeString("GPU")
	} else {
		n := 1 + fl.rng.IntN(8)
		if fl.rng.IntN(8) == 0 {
			fl.parent = 0 // a new chain
		}
		parent := fl.parent
		_ = enc.EncodeArrayLen(8)
		_ = enc.EncodeString("BlockStored")
		_ = enc.EncodeArrayLen(n)
		for range n {
			h := fl.rng.Uint64() | 1
			_ = enc.EncodeUint64(h)
			if len(fl.hashes) < 4096 {
				fl.hashes = append(fl.hashes, h)
			}
			fl.parent = h
		}
		if parent == 0 {
			_ = enc.EncodeNil()
		} else {
			_ = enc.EncodeUint64(parent)
		}
		_ = enc.EncodeArrayLen(n * blockSize)
		for range n * blockSize {
			_ = enc.EncodeUint32(uint32(fl.rng.IntN(150000)))
		}
		_ = enc.EncodeInt(blockSize)
		_ = enc.EncodeNil()
		_ = enc.EncodeString("GPU")
		_ = enc.EncodeNil()
	}
	_ = enc.EncodeInt(0)
	return buf
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
