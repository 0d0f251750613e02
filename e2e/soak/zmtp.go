package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// ZMTP 3.0 (rfc.zeromq.org/spec/23) as much as the soak needs to reach a
// ZMQ socket's message reader: the greeting, the NULL mechanism's READY
// command, and frames. Nothing here is meant to be a general ZMQ peer.

// ZMTP frame flags.
const (
	zmtpMore    = 0x01
	zmtpLong    = 0x02
	zmtpCommand = 0x04
)

// zmtpGreeting is the 64-byte greeting of a ZMTP 3.0 peer with the NULL
// mechanism.
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9] = 0xff, 0x7f // signature: 0xff, 8 bytes of padding, 0x7f
	g[10], g[11] = 3, 0     // version 3.0
	copy(g[12:32], "NULL")  // mechanism, zero-padded to 20 bytes
	// g[32] as-server = 0, then 31 bytes of filler.
	return g
}

// appendFrame appends one frame: a short one (1-byte size) up to 255
// bytes, a long one (8-byte size) beyond.
func appendFrame(dst []byte, flags byte, body []byte) []byte {
	if len(body) <= 255 {
		dst = append(dst, flags, byte(len(body)))
	} else {
		dst = append(dst, flags|zmtpLong)
		dst = binary.BigEndian.AppendUint64(dst, uint64(len(body)))
	}
	return append(dst, body...)
}

// zmtpReady is the NULL mechanism's READY command with a Socket-Type
// property.
func zmtpReady(socketType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(socketType)))
	body = append(body, socketType...)
	return appendFrame(nil, zmtpCommand, body)
}

// appendMessage appends a multipart message (MORE on all frames but the
// last).
func appendMessage(dst []byte, frames ...[]byte) []byte {
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = zmtpMore
		}
		dst = appendFrame(dst, fl, f)
	}
	return dst
}

// zmtpAddr turns "tcp://host:port" into "host:port".
func zmtpAddr(endpoint string) (string, error) {
	a, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("not a tcp:// ZMQ endpoint: %q", endpoint)
	}
	return a, nil
}

// errRefused: nothing listens at the address (an endpoint that discovery
// churn has removed, so kvbandit closed its bound socket).
var errRefused = errors.New("connection refused")

// dialTCP dials addr within timeout, mapping "connection refused" to
// errRefused.
func dialTCP(ctx context.Context, addr string, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if strings.Contains(err.Error(), "connection refused") {
			return nil, errRefused
		}
		return nil, err
	}
	return c, nil
}

// zmtpPeer is a raw connection that has completed the handshake as a
// socketType peer.
type zmtpPeer struct {
	net.Conn
}

// dialZMTP connects to a bound ZMQ socket at endpoint ("tcp://host:port")
// and completes the ZMTP 3.0 NULL handshake as a socketType peer ("PUB" to
// reach a SUB socket).
func dialZMTP(ctx context.Context, endpoint, socketType string, timeout time.Duration) (*zmtpPeer, error) {
	addr, err := zmtpAddr(endpoint)
	if err != nil {
		return nil, err
	}
	c, err := dialTCP(ctx, addr, timeout)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(timeout))
	out := append(zmtpGreeting(), zmtpReady(socketType)...)
	if _, err := c.Write(out); err != nil {
		c.Close()
		return nil, fmt.Errorf("zmtp: sending the greeting: %w", err)
	}
	if err := readGreetingAndReady(c); err != nil {
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return &zmtpPeer{c}, nil
}

// readGreetingAndReady reads the peer's greeting and its READY command
// (bounded: a command over 64 KiB is refused).
func readGreetingAndReady(r io.Reader) error {
	var g [64]byte
	if _, err := io.ReadFull(r, g[:]); err != nil {
		return fmt.Errorf("zmtp: reading the greeting: %w", err)
	}
	if g[0] != 0xff || g[9] != 0x7f || g[10] < 3 {
		return fmt.Errorf("zmtp: not a ZMTP 3 greeting: % x", g[:12])
	}
	var hdr [2]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return fmt.Errorf("zmtp: reading READY: %w", err)
	}
	if hdr[0]&zmtpCommand == 0 {
		return fmt.Errorf("zmtp: expected a command frame, got flags %#x", hdr[0])
	}
	size := uint64(hdr[1])
	if hdr[0]&zmtpLong != 0 {
		var l [8]byte
		l[0] = hdr[1]
		if _, err := io.ReadFull(r, l[1:]); err != nil {
			return fmt.Errorf("zmtp: reading READY: %w", err)
		}
		size = binary.BigEndian.Uint64(l[:])
	}
	if size > 64<<10 {
		return fmt.Errorf("zmtp: READY of %d bytes", size)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(r, body); err != nil {
		return fmt.Errorf("zmtp: reading READY: %w", err)
	}
	if !bytes.HasPrefix(body, []byte("\x05READY")) {
		return fmt.Errorf("zmtp: expected READY, got %q", body[:min(len(body), 16)])
	}
	return nil
}

// send writes one multipart message within timeout.
func (z *zmtpPeer) send(timeout time.Duration, frames ...[]byte) error {
	_ = z.SetWriteDeadline(time.Now().Add(timeout))
	_, err := z.Write(appendMessage(nil, frames...))
	return err
}
