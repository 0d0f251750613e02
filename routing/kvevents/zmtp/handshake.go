package zmtp

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"strings"
)

// SocketType is a ZMQ socket type as READY's Socket-Type property names it.
type SocketType string

// Socket types.
const (
	TypePUB    SocketType = "PUB"
	TypeXPUB   SocketType = "XPUB"
	TypeSUB    SocketType = "SUB"
	TypeXSUB   SocketType = "XSUB"
	TypeDEALER SocketType = "DEALER"
	TypeROUTER SocketType = "ROUTER"
	TypeREQ    SocketType = "REQ"
	TypeREP    SocketType = "REP"
)

// compatible reports whether a socket of type ours may talk to peer (ZMTP
// 3.1 §"Socket types" and RFC 28/29/30).
func compatible(ours, peer SocketType) bool {
	switch ours {
	case TypeSUB, TypeXSUB:
		return peer == TypePUB || peer == TypeXPUB
	case TypePUB, TypeXPUB:
		return peer == TypeSUB || peer == TypeXSUB
	case TypeDEALER:
		return peer == TypeREP || peer == TypeDEALER || peer == TypeROUTER
	case TypeROUTER:
		return peer == TypeREQ || peer == TypeDEALER || peer == TypeROUTER
	}
	return false
}

// sendsIdentity reports whether ours sends the Identity property (libzmq
// sends it for the socket types that route by it).
func sendsIdentity(t SocketType) bool {
	return t == TypeDEALER || t == TypeROUTER || t == TypeREQ
}

const greetingLen = 64

// greeting is our greeting: signature, version 3.1, mechanism NULL,
// as-server 0, filler.
func greeting() []byte {
	g := make([]byte, greetingLen)
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 1
	copy(g[12:32], "NULL")
	return g
}

// Peer describes the other end of a connection, from its greeting and
// READY command.
type Peer struct {
	// Minor is the ZMTP 3 minor version both ends speak: 0 or 1 (the lower
	// of the two). Only 3.1 peers get PINGs.
	Minor byte
	// Type is the peer's Socket-Type.
	Type SocketType
	// Identity is the peer's Identity property, if any.
	Identity []byte
}

// checkGreeting validates a peer's 64-byte greeting and returns the minor
// version to speak.
func checkGreeting(g []byte) (byte, error) {
	if g[0] != 0xff || g[9] != 0x7f {
		return 0, fmt.Errorf("%w: not a ZMTP 3 greeting", ErrProtocol)
	}
	if g[10] < 3 {
		return 0, fmt.Errorf("%w: ZMTP version %d.%d, need 3.0 or later", ErrProtocol, g[10], g[11])
	}
	minor := byte(1)
	if g[10] == 3 && g[11] == 0 {
		minor = 0
	}
	mech := g[12:32]
	if !bytes.Equal(bytes.TrimRight(mech, "\x00"), []byte("NULL")) {
		return 0, fmt.Errorf("%w: security mechanism %q, only NULL is supported", ErrProtocol, bytes.TrimRight(mech, "\x00"))
	}
	return minor, nil
}

// appendReady appends our READY command.
func appendReady(dst []byte, typ SocketType, identity []byte) []byte {
	props := appendProperty(nil, "Socket-Type", []byte(typ))
	if sendsIdentity(typ) {
		props = appendProperty(props, "Identity", identity)
	}
	return appendCommand(dst, "READY", props)
}

func appendProperty(dst []byte, name string, value []byte) []byte {
	dst = append(append(dst, byte(len(name))), name...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(value)))
	return append(dst, value...)
}

// parseReady reads the properties of a READY command's data.
func parseReady(data []byte) (p Peer, err error) {
	for len(data) > 0 {
		n := int(data[0])
		if n == 0 || len(data) < 1+n+4 {
			return Peer{}, fmt.Errorf("%w: malformed READY property", ErrProtocol)
		}
		name := string(data[1 : 1+n])
		vlen := binary.BigEndian.Uint32(data[1+n:])
		data = data[1+n+4:]
		if uint64(vlen) > uint64(len(data)) {
			return Peer{}, fmt.Errorf("%w: READY property %q of %d bytes, %d left", ErrProtocol, name, vlen, len(data))
		}
		value := data[:vlen:vlen]
		data = data[vlen:]
		switch {
		case strings.EqualFold(name, "Socket-Type"):
			p.Type = SocketType(value)
		case strings.EqualFold(name, "Identity"):
			p.Identity = value
		}
	}
	if p.Type == "" {
		return Peer{}, fmt.Errorf("%w: READY without Socket-Type", ErrProtocol)
	}
	return p, nil
}

// handshake exchanges greetings and READY commands over w and rd (which
// reads the same stream) for a socket of type typ. Deadlines are the
// caller's.
func handshake(w io.Writer, br io.Reader, rd *Reader, typ SocketType, identity []byte) (Peer, error) {
	if _, err := w.Write(greeting()); err != nil {
		return Peer{}, err
	}
	var g [greetingLen]byte
	if _, err := io.ReadFull(br, g[:]); err != nil {
		return Peer{}, unexpected(err)
	}
	minor, err := checkGreeting(g[:])
	if err != nil {
		return Peer{}, err
	}
	if _, err := w.Write(appendReady(nil, typ, identity)); err != nil {
		return Peer{}, err
	}
	msg, cmd, err := rd.Next()
	if err != nil {
		return Peer{}, unexpected(err)
	}
	if cmd == nil {
		return Peer{}, fmt.Errorf("%w: a %d-frame message before READY", ErrProtocol, len(msg))
	}
	switch cmd.Name {
	case "READY":
	case "ERROR":
		return Peer{}, fmt.Errorf("%w: %s", ErrPeerError, errorReason(cmd.Data))
	default:
		return Peer{}, fmt.Errorf("%w: %q command before READY", ErrProtocol, cmd.Name)
	}
	p, err := parseReady(cmd.Data)
	if err != nil {
		return Peer{}, err
	}
	if !compatible(typ, p.Type) {
		return Peer{}, fmt.Errorf("%w: %s cannot talk to %s", ErrIncompatible, typ, p.Type)
	}
	p.Minor = minor
	return p, nil
}

// errorReason reads an ERROR command's reason (a short string).
func errorReason(data []byte) string {
	if len(data) == 0 || len(data) < 1+int(data[0]) {
		return "no reason"
	}
	return fmt.Sprintf("%q", data[1:1+int(data[0])])
}
