package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// The hostile ZMTP peers connect to the SUB sockets kvbandit binds (bind
// mode), as anyone who can reach the port can.

func (e *env) boundTarget(rng *rand.Rand) string {
	ts := e.fleet.boundKV()
	return ts[rng.IntN(len(ts))]
}

// peerResult maps a dial error: a refused connection is an endpoint that
// churn removed (kvbandit closed its socket), not a failure.
func peerResult(err error) result {
	if err == errRefused {
		return skipped("socket closed (endpoint churned out)")
	}
	return skipped("handshake: " + shorten(err.Error(), 80))
}

// hugeFrame declares a frame (or, during the handshake, a command) of up to
// 2^63-1 bytes and sends a few.
func (e *env) hugeFrame(ctx context.Context, rng *rand.Rand) result {
	target := e.boundTarget(rng)
	size := []uint64{1 << 28, 1 << 30, 1 << 34, 1 << 40, 1 << 62, math.MaxInt64}[rng.IntN(6)]
	hdr := binary.BigEndian.AppendUint64(nil, size)
	if rng.IntN(3) == 0 {
		// In the handshake: a command frame in place of READY.
		addr, err := zmtpAddr(target)
		if err != nil {
			return failf("%v", err)
		}
		c, err := dialTCP(ctx, addr, 5*time.Second)
		if err != nil {
			return peerResult(err)
		}
		defer c.Close()
		out := append(zmtpGreeting(), zmtpCommand|zmtpLong)
		out = append(out, hdr...)
		_, _ = c.Write(append(out, "\x05READY"...))
		sleepCtx(ctx, time.Duration(500+rng.IntN(2500))*time.Millisecond)
		return ok()
	}
	p, err := dialZMTP(ctx, target, "PUB", 5*time.Second)
	if err != nil {
		return peerResult(err)
	}
	defer p.Close()
	var out []byte
	if rng.IntN(2) == 0 {
		out = appendFrame(out, zmtpMore, []byte("kv@soak@sim-model")) // a topic first
	}
	out = append(out, zmtpLong)
	out = append(out, hdr...)
	_, _ = p.Write(append(out, "0123456789abcdef"...))
	sleepCtx(ctx, time.Duration(500+rng.IntN(2500))*time.Millisecond)
	return ok()
}

// hostileMsgpack are EventBatch payloads whose declared lengths are far
// beyond the bytes present, or that nest deeply.
func hostileMsgpack(rng *rand.Rand) []byte {
	ts := []byte{0xcb, 0x41, 0xd9, 0, 0, 0, 0, 0, 0} // float64 ~1.7e9
	stored := func(tail ...byte) []byte {
		b := append([]byte{0x93}, ts...)
		b = append(b, 0x91, 0x98, 0xab)
		b = append(b, "BlockStored"...)
		return append(b, tail...)
	}
	switch rng.IntN(10) {
	case 0: // bin32 of 4 GiB
		return []byte{0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2, 3}
	case 1: // str32 of 4 GiB
		return []byte{0xdb, 0xff, 0xff, 0xff, 0xf0, 'a', 'b'}
	case 2: // array32 of 4G elements
		return []byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0}
	case 3: // map32 of 4G pairs
		return []byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0}
	case 4: // ext32 of 4 GiB
		return []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 0}
	case 5: // a BlockStored whose block_hashes claims 4G entries
		return stored(0xdd, 0xff, 0xff, 0xff, 0xff, 0xcf)
	case 6: // ... whose token_ids claims 4G entries
		return stored(0x91, 0x01, 0xc0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01)
	case 7: // ... whose block hash is a 4 GiB bin32
		return stored(0x91, 0xc6, 0xff, 0xff, 0xff, 0xff, 0x01)
	case 8: // 100,000 nested one-element arrays
		b := make([]byte, 100000)
		for i := range b {
			b[i] = 0x91
		}
		return b
	}
	// ... whose medium is a 4 GiB str32
	return stored(0x91, 0x01, 0xc0, 0x90, 0x10, 0xc0, 0xdb, 0xff, 0xff, 0xff, 0xff, 'G')
}

// badMsgpack sends well-framed KV event messages with hostile payloads,
// and now and then messages of the wrong shape.
func (e *env) badMsgpack(ctx context.Context, rng *rand.Rand) result {
	p, err := dialZMTP(ctx, e.boundTarget(rng), "PUB", 5*time.Second)
	if err != nil {
		return peerResult(err)
	}
	defer p.Close()
	for range 1 + rng.IntN(4) {
		seq := binary.BigEndian.AppendUint64(nil, rng.Uint64N(1000))
		frames := [][]byte{[]byte("kv@soak@sim-model"), seq, hostileMsgpack(rng)}
		switch rng.IntN(6) {
		case 0:
			frames = frames[:2] // two frames
		case 1:
			frames[1] = []byte{1, 2, 3} // a short sequence number
		case 2:
			frames = append(frames, []byte("extra"), []byte("frames"))
		}
		if err := p.send(5*time.Second, frames...); err != nil {
			return ok() // kvbandit dropped the connection: fine
		}
	}
	sleepCtx(ctx, time.Duration(100+rng.IntN(900))*time.Millisecond)
	return ok()
}

// garbage connects and sends bytes that are not ZMTP, or a greeting that
// is wrong in one way.
func (e *env) garbage(ctx context.Context, rng *rand.Rand) result {
	addr, err := zmtpAddr(e.boundTarget(rng))
	if err != nil {
		return failf("%v", err)
	}
	c, err := dialTCP(ctx, addr, 5*time.Second)
	if err != nil {
		return peerResult(err)
	}
	defer c.Close()
	g := zmtpGreeting()
	var out []byte
	switch rng.IntN(7) {
	case 0: // random bytes
		out = make([]byte, 1+rng.IntN(4096))
		for i := range out {
			out[i] = byte(rng.Uint32())
		}
	case 1: // a bad signature
		g[9] = 0x00
		out = g
	case 2: // ZMTP 2
		g[10] = 1
		out = g
	case 3: // a mechanism we do not speak
		copy(g[12:32], "CURVE\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00")
		out = append(g, zmtpReady("PUB")...)
	case 4: // an incompatible socket type
		out = append(g, zmtpReady("ROUTER")...)
	case 5: // READY whose property value claims 4 GiB
		body := append([]byte{5}, "READY"...)
		body = append(body, 11)
		body = append(body, "Socket-Type"...)
		body = append(body, 0xff, 0xff, 0xff, 0xff)
		out = append(g, appendFrame(nil, zmtpCommand, append(body, "PUB"...))...)
	default: // a handshake, then random frames
		out = append(g, zmtpReady("PUB")...)
		for range 1 + rng.IntN(8) {
			f := make([]byte, rng.IntN(300))
			for i := range f {
				f[i] = byte(rng.Uint32())
			}
			out = appendFrame(out, byte(rng.IntN(2)), f)
		}
	}
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(out)
	sleepCtx(ctx, time.Duration(100+rng.IntN(900))*time.Millisecond)
	return ok()
}

// stall connects and sends nothing, or half a greeting, for 5 to 15 s: a
// socket that handshakes in its accept loop serves nobody meanwhile.
func (e *env) stall(ctx context.Context, rng *rand.Rand) result {
	addr, err := zmtpAddr(e.boundTarget(rng))
	if err != nil {
		return failf("%v", err)
	}
	c, err := dialTCP(ctx, addr, 5*time.Second)
	if err != nil {
		return peerResult(err)
	}
	defer c.Close()
	if rng.IntN(2) == 0 {
		_, _ = c.Write(zmtpGreeting()[:10])
	}
	sleepCtx(ctx, time.Duration(5000+rng.IntN(10000))*time.Millisecond)
	return ok()
}

// describeMode names the KV modes of the fleet for the header.
func describeMode(f *fleet) string {
	n := map[kvMode]int{}
	for _, w := range f.workers {
		n[w.mode]++
	}
	return fmt.Sprintf("%d connect-mode, %d bind-mode, %d flood-fed", n[kvConnect], n[kvBind], n[kvFlood])
}
