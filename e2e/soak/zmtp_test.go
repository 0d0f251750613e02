package main

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvevents"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// The raw ZMTP peer gets past the handshake of kvbandit's own bound SUB
// socket, and the flood's batches decode into the events they claim: the
// hostile classes that use the same peer do reach the message decoder.
func TestRawPeerReachesBoundSubscriber(t *testing.T) {
	var stored, removed atomic.Int64
	sub, err := kvevents.Subscribe(t.Context(), kvevents.Config{Endpoint: "w", Address: "tcp://127.0.0.1:0", Bind: true}, kvevents.Deps{
		Apply: func(_ string, _ int, ev kvindex.Event) error {
			switch ev.Kind {
			case kvindex.Stored:
				stored.Add(int64(len(ev.Blocks)))
			case kvindex.Removed:
				removed.Add(int64(len(ev.RemovedHashes)))
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	endpoint := "tcp://" + sub.Addr().String()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	p, err := dialZMTP(ctx, endpoint, "PUB", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	fl := &flooder{rng: rand.New(rand.NewPCG(1, 2)), t: newTally()}
	want := 0
	for seq := range uint64(200) {
		batch := fl.batch()
		b, err := kvevents.Decode([][]byte{[]byte("kv@w@sim-model"), binary.BigEndian.AppendUint64(nil, seq), batch})
		if err != nil {
			t.Fatalf("batch %d does not decode: %v", seq, err)
		}
		want += b.Blocks
		if err := p.send(5*time.Second, []byte("kv@w@sim-model"), binary.BigEndian.AppendUint64(nil, seq), batch); err != nil {
			t.Fatal(err)
		}
	}
	for stored.Load() < int64(want) {
		if ctx.Err() != nil {
			t.Fatalf("stored %d of %d blocks; stats %+v", stored.Load(), want, sub.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st := sub.Stats(); st.Malformed != 0 || removed.Load() == 0 {
		t.Fatalf("malformed %d, removed %d: the flood should send both kinds; stats %+v", st.Malformed, removed.Load(), st)
	}
}

// A peer that is not a ZMQ socket is refused by dialZMTP rather than
// taken for one.
func TestDialZMTPRejectsNonZMTP(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	addrs, err := freeAddrs(1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dialZMTP(ctx, "tcp://"+addrs[0], "PUB", time.Second); err != errRefused {
		t.Fatalf("nothing listening: err %v, want errRefused", err)
	}
	if _, err := dialZMTP(ctx, addrs[0], "PUB", time.Second); err == nil {
		t.Fatal("an address without tcp:// accepted")
	}
}

func TestFrames(t *testing.T) {
	short := appendFrame(nil, zmtpMore, []byte("abc"))
	if string(short) != "\x01\x03abc" {
		t.Fatalf("short frame % x", short)
	}
	long := appendFrame(nil, 0, make([]byte, 300))
	if long[0] != zmtpLong || binary.BigEndian.Uint64(long[1:9]) != 300 || len(long) != 309 {
		t.Fatalf("long frame header % x, length %d", long[:9], len(long))
	}
	msg := appendMessage(nil, []byte("a"), []byte("b"))
	if string(msg) != "\x01\x01a\x00\x01b" {
		t.Fatalf("message % x", msg)
	}
	if g := zmtpGreeting(); len(g) != 64 || g[0] != 0xff || g[9] != 0x7f || g[10] != 3 || string(g[12:16]) != "NULL" {
		t.Fatalf("greeting % x", g)
	}
}
