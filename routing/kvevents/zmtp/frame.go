package zmtp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Errors a connection ends with. Protocol violations and limits wrap
// ErrProtocol.
var (
	// ErrProtocol means the peer broke ZMTP: a bad greeting, flags,
	// command or handshake.
	ErrProtocol = errors.New("zmtp: protocol error")
	// ErrTooLarge means a frame or message is over the [Limits]; it also
	// wraps ErrProtocol.
	ErrTooLarge = fmt.Errorf("%w: over the size limits", ErrProtocol)
	// ErrIncompatible means the peer's socket type cannot talk to ours.
	ErrIncompatible = fmt.Errorf("%w: incompatible socket type", ErrProtocol)
	// ErrPeerError means the peer sent an ERROR command.
	ErrPeerError = errors.New("zmtp: peer reported an error")
	// ErrClosed means the socket was closed.
	ErrClosed = errors.New("zmtp: closed")
)

// Frame flags (ZMTP 3.x §"Framing").
const (
	FlagMore    = 0x01
	FlagLong    = 0x02
	FlagCommand = 0x04
)

// Limits bound what one peer may make us hold. Zero fields take the
// defaults.
type Limits struct {
	// MaxFrameSize bounds one data frame's body; default 16 MiB.
	MaxFrameSize int
	// MaxMessageSize bounds the bodies of all frames of one message
	// together; default 32 MiB.
	MaxMessageSize int
	// MaxFrames bounds the frames of one message; default 16.
	MaxFrames int
	// MaxCommandSize bounds one command frame (READY, PING, ...); default
	// 64 KiB.
	MaxCommandSize int
}

// Defaults of [Limits]. A vLLM KV-event message is three frames (topic,
// 8-byte sequence number, msgpack batch) and its batch is at most a few
// MiB (see kvevents' decode limits); a replay reply is the same plus an
// empty delimiter.
const (
	DefaultMaxFrameSize   = 16 << 20
	DefaultMaxMessageSize = 32 << 20
	DefaultMaxFrames      = 16
	DefaultMaxCommandSize = 64 << 10
)

func (l Limits) withDefaults() Limits {
	if l.MaxFrameSize <= 0 {
		l.MaxFrameSize = DefaultMaxFrameSize
	}
	if l.MaxMessageSize <= 0 {
		l.MaxMessageSize = DefaultMaxMessageSize
	}
	if l.MaxFrames <= 0 {
		l.MaxFrames = DefaultMaxFrames
	}
	if l.MaxCommandSize <= 0 {
		l.MaxCommandSize = DefaultMaxCommandSize
	}
	return l
}

// chunk is how much of a frame body is allocated ahead of its bytes
// arriving; larger bodies grow as they are read.
const chunk = 64 << 10

// readFrame reads one frame whose body may be at most dataMax bytes, or
// cmdMax for a command. The declared length is checked before anything is
// allocated, and a body over chunk bytes is allocated as it arrives (at
// most twice the bytes read, plus chunk).
func readFrame(r io.Reader, hdr *[8]byte, dataMax, cmdMax int) (flags byte, body []byte, err error) {
	if _, err := io.ReadFull(r, hdr[:2]); err != nil {
		return 0, nil, err
	}
	flags = hdr[0]
	if flags&^(FlagMore|FlagLong|FlagCommand) != 0 {
		return 0, nil, fmt.Errorf("%w: reserved frame flags 0x%02x", ErrProtocol, flags)
	}
	size := uint64(hdr[1])
	if flags&FlagLong != 0 {
		hdr[0] = hdr[1]
		if _, err := io.ReadFull(r, hdr[1:8]); err != nil {
			return 0, nil, unexpected(err)
		}
		size = binary.BigEndian.Uint64(hdr[:])
	}
	limit := dataMax
	if flags&FlagCommand != 0 {
		limit = cmdMax
	}
	if size > uint64(limit) {
		return 0, nil, fmt.Errorf("%w: frame of %d bytes, limit %d", ErrTooLarge, size, limit)
	}
	body, err = readBody(r, int(size))
	return flags, body, unexpected(err)
}

// readBody reads n bytes, allocating no more than about twice what has
// arrived (plus chunk) at any time.
func readBody(r io.Reader, n int) ([]byte, error) {
	if n <= chunk {
		b := make([]byte, n)
		_, err := io.ReadFull(r, b)
		return b, err
	}
	b := make([]byte, chunk)
	got := 0
	for {
		m, err := io.ReadFull(r, b[got:])
		got += m
		if err != nil {
			return nil, err
		}
		if got == n {
			return b, nil
		}
		nb := make([]byte, min(2*len(b), n))
		copy(nb, b)
		b = nb
	}
}

// unexpected turns an EOF inside a frame into io.ErrUnexpectedEOF.
func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// Command is a ZMTP command frame: a name and its data.
type Command struct {
	Name string
	Data []byte
}

func parseCommand(body []byte) (Command, error) {
	if len(body) < 1 || int(body[0]) == 0 || len(body) < 1+int(body[0]) {
		return Command{}, fmt.Errorf("%w: malformed command of %d bytes", ErrProtocol, len(body))
	}
	n := int(body[0])
	return Command{Name: string(body[1 : 1+n]), Data: body[1+n:]}, nil
}

// Reader reads frames from a ZMTP stream after the greeting and assembles
// them into messages, returning commands as they come (a command may
// arrive between the frames of a message; the message continues after
// it).
type Reader struct {
	r   io.Reader
	lim Limits
	hdr [8]byte

	// The message being assembled.
	frames [][]byte
	size   int
}

// NewReader returns a Reader of r under lim (zero fields take defaults).
func NewReader(r io.Reader, lim Limits) *Reader {
	return &Reader{r: r, lim: lim.withDefaults()}
}

// Next returns the next complete message (cmd is nil) or command (msg is
// nil). The frames of msg are owned by the caller. An error ends the
// stream: io.EOF at a frame boundary between messages, else
// io.ErrUnexpectedEOF, an error wrapping ErrProtocol, or the reader's.
func (r *Reader) Next() (msg [][]byte, cmd *Command, err error) {
	for {
		room := min(r.lim.MaxFrameSize, r.lim.MaxMessageSize-r.size)
		if len(r.frames) == r.lim.MaxFrames {
			room = 0 // only a command, or an empty frame to reject below
		}
		flags, body, err := readFrame(r.r, &r.hdr, room, r.lim.MaxCommandSize)
		if err != nil {
			if errors.Is(err, io.EOF) && len(r.frames) > 0 {
				err = io.ErrUnexpectedEOF
			}
			return nil, nil, err
		}
		if flags&FlagCommand != 0 {
			if flags&FlagMore != 0 {
				return nil, nil, fmt.Errorf("%w: command frame with MORE", ErrProtocol)
			}
			c, err := parseCommand(body)
			if err != nil {
				return nil, nil, err
			}
			return nil, &c, nil
		}
		if len(r.frames) == r.lim.MaxFrames {
			return nil, nil, fmt.Errorf("%w: message of more than %d frames", ErrTooLarge, r.lim.MaxFrames)
		}
		r.frames = append(r.frames, body)
		r.size += len(body)
		if flags&FlagMore == 0 {
			msg = r.frames
			r.frames, r.size = nil, 0
			return msg, nil, nil
		}
	}
}

// appendFrame appends one frame's header and body to dst.
func appendFrame(dst []byte, flags byte, body []byte) []byte {
	if len(body) > 255 {
		dst = append(dst, flags|FlagLong)
		dst = binary.BigEndian.AppendUint64(dst, uint64(len(body)))
	} else {
		dst = append(dst, flags, byte(len(body)))
	}
	return append(dst, body...)
}

// appendCommand appends a command frame.
func appendCommand(dst []byte, name string, data ...[]byte) []byte {
	n := 1 + len(name)
	for _, d := range data {
		n += len(d)
	}
	body := make([]byte, 0, n)
	body = append(append(body, byte(len(name))), name...)
	for _, d := range data {
		body = append(body, d...)
	}
	return appendFrame(dst, FlagCommand, body)
}
