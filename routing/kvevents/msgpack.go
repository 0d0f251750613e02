package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
)

// mpReader reads msgpack values from a byte slice. It never allocates on
// behalf of the input: strings and byte strings are returned as views of
// the slice, and every declared length is checked against the bytes left
// before it is used, so a 5-byte header claiming 4 GiB costs nothing.
type mpReader struct {
	b   []byte
	off int
}

func (r *mpReader) left() int { return len(r.b) - r.off }

func (r *mpReader) errf(format string, args ...any) error {
	return fmt.Errorf("%w: %s at byte %d", ErrMalformed, fmt.Sprintf(format, args...), r.off)
}

// msgpack format classes, from the first byte.
type class uint8

const (
	clsOther class = iota // reserved 0xc1
	clsNil
	clsBool
	clsInt
	clsFloat
	clsStr
	clsBin
	clsArray
	clsMap
	clsExt
)

// classes maps every first byte to its class.
var classes = func() (t [256]class) {
	for c := range 256 {
		t[c] = classify(byte(c))
	}
	return t
}()

func classify(c byte) class {
	switch {
	case c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3):
		return clsInt
	case c <= 0x8f, c == 0xde, c == 0xdf:
		return clsMap
	case c <= 0x9f, c == 0xdc, c == 0xdd:
		return clsArray
	case c <= 0xbf, c >= 0xd9 && c <= 0xdb:
		return clsStr
	case c == 0xc0:
		return clsNil
	case c == 0xc2, c == 0xc3:
		return clsBool
	case c >= 0xc4 && c <= 0xc6:
		return clsBin
	case c == 0xca, c == 0xcb:
		return clsFloat
	case c >= 0xc7 && c <= 0xc9, c >= 0xd4 && c <= 0xd8:
		return clsExt
	}
	return clsOther
}

// peek returns the class and first byte of the next value.
func (r *mpReader) peek() (class, byte, error) {
	if r.off >= len(r.b) {
		return clsOther, 0, r.errf("truncated")
	}
	c := r.b[r.off]
	return classes[c], c, nil
}

// uintN reads an n-byte big-endian unsigned integer (n is 1, 2, 4 or 8).
func (r *mpReader) uintN(n int) (uint64, error) {
	if r.left() < n {
		return 0, r.errf("truncated %d-byte number", n)
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	switch n {
	case 1:
		return uint64(p[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), nil
	}
	return binary.BigEndian.Uint64(p), nil
}

// header reads the first byte and the length that follows it for str,
// bin, array, map and ext formats. For fixed formats the length comes from
// the first byte. It does not check the length.
func (r *mpReader) header() (c byte, n uint64, err error) {
	c = r.b[r.off] // callers peeked
	r.off++
	switch {
	case c >= 0x80 && c <= 0x8f:
		return c, uint64(c & 0x0f), nil
	case c >= 0x90 && c <= 0x9f:
		return c, uint64(c & 0x0f), nil
	case c >= 0xa0 && c <= 0xbf:
		return c, uint64(c & 0x1f), nil
	}
	switch c {
	case 0xc4, 0xd9, 0xc7: // bin8, str8, ext8
		n, err = r.uintN(1)
	case 0xc5, 0xda, 0xc8, 0xdc, 0xde: // bin16, str16, ext16, array16, map16
		n, err = r.uintN(2)
	case 0xc6, 0xdb, 0xc9, 0xdd, 0xdf: // bin32, str32, ext32, array32, map32
		n, err = r.uintN(4)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16
		n = 1 << (c - 0xd4)
	default:
		err = r.errf("format 0x%02x has no length", c)
	}
	return c, n, err
}

// length reads an array or map header and checks it against the bytes
// left (an element takes at least one byte, a map entry two).
func (r *mpReader) length(cls class) (int, error) {
	_, n, err := r.header()
	if err != nil {
		return 0, err
	}
	per := uint64(1)
	if cls == clsMap {
		per = 2
	}
	if n > uint64(r.left())/per {
		return 0, r.errf("%d elements declared, %d bytes left", n, r.left())
	}
	return int(n), nil
}

// bytesOf reads a str or bin value of at most limit bytes and returns a
// view of it. The declared length is checked against limit and the bytes
// left before anything else happens.
func (r *mpReader) bytesOf(what string, limit int) ([]byte, error) {
	start := r.off
	_, n, err := r.header()
	if err != nil {
		return nil, err
	}
	if n > uint64(limit) {
		r.off = start
		return nil, r.errf("%s of %d bytes, limit %d", what, n, limit)
	}
	if n > uint64(r.left()) {
		r.off = start
		return nil, r.errf("%s of %d bytes, %d left", what, n, r.left())
	}
	v := r.b[r.off : r.off+int(n) : r.off+int(n)]
	r.off += int(n)
	return v, nil
}

// str reads a string of at most limit bytes.
func (r *mpReader) str(what string, limit int) ([]byte, error) {
	cls, _, err := r.peek()
	if err != nil {
		return nil, err
	}
	if cls != clsStr {
		return nil, r.errf("%s is not a string", what)
	}
	return r.bytesOf(what, limit)
}

// int reads any integer format as int64; uint64 values above MaxInt64
// are an error.
func (r *mpReader) int() (int64, error) {
	u, neg, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, r.errf("integer %d out of range", u)
	}
	return int64(u), nil
}

// integer reads any integer format: the value's two's complement bits and
// whether it came from a signed format holding a negative number.
func (r *mpReader) integer() (bits uint64, neg bool, err error) {
	if r.off >= len(r.b) {
		return 0, false, r.errf("truncated")
	}
	c := r.b[r.off]
	switch {
	case c <= 0x7f:
		r.off++
		return uint64(c), false, nil
	case c >= 0xe0:
		r.off++
		return uint64(int64(int8(c))), true, nil
	}
	r.off++
	var u uint64
	switch c {
	case 0xcc, 0xd0:
		u, err = r.uintN(1)
		if c == 0xd0 {
			u = uint64(int64(int8(u)))
		}
	case 0xcd, 0xd1:
		u, err = r.uintN(2)
		if c == 0xd1 {
			u = uint64(int64(int16(u)))
		}
	case 0xce, 0xd2:
		u, err = r.uintN(4)
		if c == 0xd2 {
			u = uint64(int64(int32(u)))
		}
	case 0xcf, 0xd3:
		u, err = r.uintN(8)
	default:
		r.off--
		return 0, false, r.errf("format 0x%02x is not an integer", c)
	}
	return u, c >= 0xd0 && int64(u) < 0, err
}

// float reads a float32, float64 or integer as float64.
func (r *mpReader) float() (float64, error) {
	cls, c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch cls {
	case clsFloat:
		r.off++
		if c == 0xca {
			u, err := r.uintN(4)
			return float64(math.Float32frombits(uint32(u))), err
		}
		u, err := r.uintN(8)
		return math.Float64frombits(u), err
	case clsInt:
		i, err := r.int()
		return float64(i), err
	}
	return 0, r.errf("expected a number")
}

// skip skips n values. It keeps a count of values still to skip instead
// of recursing, so nesting depth costs no memory; the count never exceeds
// the bytes left, since every element was checked to fit.
func (r *mpReader) skip(n int) error {
	for n > 0 {
		n--
		cls, c, err := r.peek()
		if err != nil {
			return err
		}
		switch cls {
		case clsNil, clsBool:
			r.off++
		case clsInt:
			if _, _, err := r.integer(); err != nil {
				return err
			}
		case clsFloat:
			r.off++
			size := 8
			if c == 0xca {
				size = 4
			}
			if _, err := r.uintN(size); err != nil {
				return err
			}
		case clsStr, clsBin:
			if _, err := r.bytesOf("value", math.MaxInt32); err != nil {
				return err
			}
		case clsExt:
			_, l, err := r.header()
			if err != nil {
				return err
			}
			if l+1 > uint64(r.left()) { // the type byte, then the data
				return r.errf("extension of %d bytes, %d left", l, r.left())
			}
			r.off += int(l) + 1
		case clsArray, clsMap:
			l, err := r.length(cls)
			if err != nil {
				return err
			}
			if cls == clsMap {
				l *= 2
			}
			n += l
		default:
			return r.errf("reserved format 0x%02x", c)
		}
	}
	return nil
}
