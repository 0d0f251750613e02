package kvevents

import (
	"encoding/binary"
	"math"

	"github.com/zeebo/xxh3"
)

// rank reads a batch's data_parallel_rank: an integer in [0, MaxInt32],
// or nil for rank 0.
func (dc *decoder) rank() (int, error) {
	v, ok, err := dc.optInt()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, nil
	}
	if v < 0 || v > math.MaxInt32 {
		return 0, dc.errf("data_parallel_rank %d out of range", v)
	}
	return int(v), nil
}

// optInt reads an integer or nil.
func (dc *decoder) optInt() (int64, bool, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return 0, false, nil
	case clsInt:
		i, err := dc.int()
		return i, err == nil, err
	}
	return 0, false, dc.errf("expected an integer or nil")
}

// optString reads a string of at most MaxStringBytes, or nil (as an empty
// view). The result aliases the payload.
func (dc *decoder) optString(what string) ([]byte, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return nil, nil
	case clsStr:
		return dc.bytesOf(what, MaxStringBytes)
	}
	return nil, dc.errf("%s is neither a string nor nil", what)
}

// hash reads an engine block hash: an integer (taken bitwise), or bytes or
// a string of at most MaxHashBytes (xxh3-64 of the bytes). ok is false for
// nil.
func (dc *decoder) hash() (h uint64, ok bool, err error) {
	cls, c, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return 0, false, nil
	case clsInt:
		if c <= 0x7f {
			dc.off++
			return uint64(c), true, nil
		}
		u, _, err := dc.integer()
		return u, err == nil, err
	case clsBin, clsStr:
		bs, err := dc.bytesOf("block hash", MaxHashBytes)
		if err != nil {
			return 0, false, err
		}
		return xxh3.Hash(bs), true, nil
	}
	return 0, false, dc.errf("block hash is neither an integer nor bytes")
}

// boundedArray reads the header of an array field, or nil (ok false): at
// most perEvent elements, added to *inBatch, which must stay at most
// perBatch. field names the field in errors ("block_hashes"), items its
// elements ("block hashes").
func (dc *decoder) boundedArray(field, items string, perEvent, perBatch int, inBatch *int) (n int, ok bool, err error) {
	cls, _, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	if cls == clsNil {
		dc.off++
		return 0, false, nil
	}
	if cls != clsArray {
		return 0, false, dc.errf("%s is not an array", field)
	}
	n, err = dc.length(cls)
	if err != nil {
		return 0, false, err
	}
	if n > perEvent {
		return 0, false, dc.errf("%d %s in one event, limit %d", n, items, perEvent)
	}
	if *inBatch += n; *inBatch > perBatch {
		return 0, false, dc.errf("more than %d %s in one batch", perBatch, items)
	}
	return n, true, nil
}

func (dc *decoder) hashes() ([]uint64, error) {
	n, ok, err := dc.boundedArray("block_hashes", "block hashes", MaxBlocksPerEvent, MaxBlocksPerBatch, &dc.blocks)
	if err != nil || !ok || n == 0 {
		return nil, err
	}
	out := make([]uint64, n)
	for i := range out {
		h, ok, err := dc.hash()
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, dc.errf("nil block hash")
		}
		out[i] = h
	}
	return out, nil
}

func (dc *decoder) tokenIDs() ([]uint32, error) {
	n, ok, err := dc.boundedArray("token_ids", "token ids", MaxTokensPerEvent, MaxTokensPerBatch, &dc.tokens)
	if err != nil || !ok {
		return nil, err
	}
	toks := make([]uint32, n)
	p := dc.b
	for i := range toks {
		// Fast paths for the unsigned formats tokens come in; the length
		// check above guarantees a first byte per remaining element, not
		// the bytes after it.
		off := dc.off
		if off >= len(p) {
			return nil, dc.errf("truncated")
		}
		switch c := p[off]; {
		case c <= 0x7f: // positive fixint
			toks[i] = uint32(c)
			dc.off = off + 1
			continue
		case c == 0xcd && off+3 <= len(p): // uint16
			toks[i] = uint32(binary.BigEndian.Uint16(p[off+1:]))
			dc.off = off + 3
			continue
		case c == 0xce && off+5 <= len(p): // uint32
			toks[i] = binary.BigEndian.Uint32(p[off+1:])
			dc.off = off + 5
			continue
		case classes[c] != clsInt:
			// Eagle bigram pairs and other shapes are not token ids.
			return nil, dc.errf("token id %d is not an integer", i)
		}
		v, err := dc.int()
		if err != nil {
			return nil, err
		}
		if v < 0 || v > math.MaxUint32 {
			return nil, dc.errf("token id %d out of range", v)
		}
		toks[i] = uint32(v)
	}
	return toks, nil
}
