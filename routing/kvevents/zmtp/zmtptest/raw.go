package zmtptest

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// The helpers below write ZMTP by hand, independently of package zmtp, so
// tests can play peers that misbehave at any byte.

// Greeting is a ZMTP 3.minor greeting with the NULL mechanism.
func Greeting(minor byte) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, minor
	copy(g[12:], "NULL")
	return g
}

// Frame is one frame with flags (0x01 more, 0x04 command); the long flag
// is added when the body needs it.
func Frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flags | 0x02}, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// Ready is a READY command frame for socket type typ.
func Ready(typ string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(append(body, 11), "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(typ)))
	return Frame(0x04, append(body, typ...))
}

// Handshake runs a hand-written ZMTP 3.minor handshake on c as a socket of
// type typ: it sends its greeting and READY and reads the peer's.
func Handshake(c net.Conn, typ string, minor byte) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(append(Greeting(minor), Ready(typ)...)); err != nil {
		return err
	}
	g := make([]byte, 64)
	if _, err := io.ReadFull(c, g); err != nil {
		return fmt.Errorf("peer greeting: %w", err)
	}
	flags, body, err := ReadFrame(c)
	if err != nil {
		return fmt.Errorf("peer READY: %w", err)
	}
	if flags&0x04 == 0 || len(body) < 6 || string(body[1:6]) != "READY" {
		return fmt.Errorf("peer sent flags 0x%02x %q instead of READY", flags, body)
	}
	return nil
}

// ReadFrame reads one frame of at most 1 MiB.
func ReadFrame(r io.Reader) (flags byte, body []byte, err error) {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:2]); err != nil {
		return 0, nil, err
	}
	size := uint64(h[1])
	if h[0]&0x02 != 0 {
		if _, err := io.ReadFull(r, h[2:]); err != nil {
			return 0, nil, err
		}
		size = binary.BigEndian.Uint64(h[1:])
	}
	if size > 1<<20 {
		return 0, nil, fmt.Errorf("frame of %d bytes", size)
	}
	body = make([]byte, size)
	_, err = io.ReadFull(r, body)
	return h[0], body, err
}

// DialPub connects to a bound SUB at addr ("host:port") and handshakes as
// a ZMTP 3.0 PUB.
func DialPub(addr string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	if err := Handshake(c, "PUB", 0); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
