package wire

import (
	"encoding/binary"
	"fmt"
)

// Append appends the encoding of m to dst and returns the extended
// buffer. A value over a limit is refused with an error wrapping
// [ErrTooLarge] (the whole message included: at most [MaxMessage] bytes),
// an unknown Kind or item kind with [ErrMalformed]; on error dst is
// returned with its length unchanged.
func Append(dst []byte, m *Message) ([]byte, error) {
	start := len(dst)
	out, err := appendMessage(dst, m, start)
	if err == nil && len(out)-start > MaxMessage {
		err = fmt.Errorf("%w: message is %d bytes, limit %d", ErrTooLarge, len(out)-start, MaxMessage)
	}
	if err != nil {
		return dst[:start], err
	}
	return out, nil
}

func appendMessage(b []byte, m *Message, start int) ([]byte, error) {
	if m.Kind < KindBatch || m.Kind > KindStateChunk {
		return b, fmt.Errorf("%w: unknown message kind %d", ErrMalformed, m.Kind)
	}
	if err := checkLen("pool", len(m.Pool), MaxIDLen); err != nil {
		return b, err
	}
	if err := checkLen("replica", len(m.Replica), MaxIDLen); err != nil {
		return b, err
	}
	b = append(b, Version, byte(m.Kind))
	b = appendString(b, m.Pool)
	b = appendString(b, m.Replica)
	b = binary.LittleEndian.AppendUint64(b, m.Epoch)
	b = binary.AppendUvarint(b, m.Seq)
	var err error
	switch m.Kind {
	case KindBatch:
		b, err = appendBatch(b, m.Batch, start)
	case KindSnapshot:
		b, err = appendSnapshot(b, m.Snapshot, start)
	case KindHeartbeat:
		b = binary.AppendUvarint(b, uint64(m.Heartbeat.InFlight))
		b = binary.AppendUvarint(b, uint64(m.Heartbeat.Interval))
	case KindKVEvents:
		b, err = appendKVEvents(b, &m.KVEvents)
	case KindStateRequest:
		b, err = appendStateRequest(b, &m.StateRequest)
	case KindStateChunk:
		b, err = appendStateChunk(b, &m.StateChunk, start)
	}
	return b, err
}

func appendBatch(b []byte, items []Item, start int) ([]byte, error) {
	if err := checkLen("batch items", len(items), MaxItems); err != nil {
		return b, err
	}
	b = binary.AppendUvarint(b, uint64(len(items)))
	total := 0
	for i := range items {
		it := &items[i]
		var err error
		switch it.Kind {
		case ItemStart:
			total += len(it.Start.Blocks)
			if err = checkLen("blocks in the message", total, MaxTotalBlocks); err != nil {
				return b, err
			}
			b = append(b, byte(ItemStart))
			b, err = appendStart(b, &it.Start)
		case ItemFirst, ItemEnd:
			b = append(b, byte(it.Kind))
			b = binary.AppendUvarint(b, it.ID)
		case ItemOutcome:
			b = append(b, byte(ItemOutcome))
			b, err = appendOutcome(b, &it.Outcome)
		default:
			err = fmt.Errorf("%w: batch item %d has unknown kind %d", ErrMalformed, i, it.Kind)
		}
		if err != nil {
			return b, err
		}
		if err := checkSize(b, start); err != nil {
			return b, err
		}
	}
	return b, nil
}

func appendSnapshot(b []byte, starts []Start, start int) ([]byte, error) {
	if err := checkLen("snapshot starts", len(starts), MaxSnapshotStarts); err != nil {
		return b, err
	}
	b = binary.AppendUvarint(b, uint64(len(starts)))
	total := 0
	for i := range starts {
		total += len(starts[i].Blocks)
		if err := checkLen("blocks in the message", total, MaxTotalBlocks); err != nil {
			return b, err
		}
		var err error
		if b, err = appendStart(b, &starts[i]); err != nil {
			return b, err
		}
		if err := checkSize(b, start); err != nil {
			return b, err
		}
	}
	return b, nil
}

func appendStart(b []byte, s *Start) ([]byte, error) {
	if err := checkLen("start blocks", len(s.Blocks), MaxBlocks); err != nil {
		return b, err
	}
	if err := checkStrings(s.Endpoint, s.PrefixID, s.Tenant, s.Model); err != nil {
		return b, err
	}
	if err := checkLen("prefill endpoint", len(s.PrefillEndpoint), MaxStringLen); err != nil {
		return b, err
	}
	b = binary.AppendUvarint(b, s.ID)
	b = appendString(b, s.Endpoint)
	b = binary.AppendVarint(b, int64(s.DPRank))
	b = binary.AppendUvarint(b, uint64(s.BlockSize))
	b = binary.AppendUvarint(b, uint64(len(s.Blocks)))
	for _, k := range s.Blocks {
		b = binary.LittleEndian.AppendUint64(b, k)
	}
	b = binary.AppendUvarint(b, uint64(s.ISL))
	b = binary.AppendUvarint(b, uint64(s.Overlap))
	b = binary.AppendUvarint(b, uint64(s.ExpectedDecodeBlocks))
	b = appendString(b, s.PrefixID)
	b = appendString(b, s.Tenant)
	b = appendString(b, s.Model)
	b = binary.AppendUvarint(b, uint64(s.TTL))
	b = binary.AppendUvarint(b, uint64(s.TotalRequests))
	b = append(b, s.OSL)
	b = binary.AppendUvarint(b, uint64(s.OSLTokens))
	b = append(b, s.IAT)
	b = binary.AppendUvarint(b, uint64(s.MaxTokens))
	var flags byte
	if s.Prefilled {
		flags |= flagPrefilled
	}
	if s.PrefillEndpoint == "" {
		// Aggregated: the bit stays 0, so replicas that predate P/D
		// starts (which refuse unknown bits) decode it.
		return append(b, flags), nil
	}
	b = append(b, flags|flagPrefill)
	b = appendString(b, s.PrefillEndpoint)
	b = binary.AppendVarint(b, int64(s.PrefillDPRank))
	return binary.AppendUvarint(b, uint64(s.PrefillCached)), nil
}

func appendOutcome(b []byte, o *Outcome) ([]byte, error) {
	if err := checkStrings(o.Endpoint, o.PrefixID, o.Tenant, o.Model); err != nil {
		return b, err
	}
	if err := checkLen("served", len(o.Served), MaxStringLen); err != nil {
		return b, err
	}
	b = binary.AppendUvarint(b, o.ID)
	b = appendString(b, o.Endpoint)
	b = binary.AppendVarint(b, int64(o.DPRank))
	b = append(b, o.Kind)
	b = binary.AppendUvarint(b, uint64(o.Status))
	b = binary.AppendUvarint(b, uint64(o.TTFTMicros))
	b = binary.AppendUvarint(b, uint64(o.LatencyMicros))
	b = binary.AppendVarint(b, int64(o.PromptTokens))
	b = binary.AppendVarint(b, int64(o.CompletionTokens))
	b = binary.AppendVarint(b, int64(o.CachedTokens))
	b = appendString(b, o.PrefixID)
	b = appendString(b, o.Tenant)
	b = appendString(b, o.Model)
	b = appendString(b, o.Served)
	b = binary.AppendUvarint(b, uint64(o.BlockSize))
	b = binary.AppendUvarint(b, uint64(o.ISL))
	b = binary.AppendUvarint(b, uint64(o.Overlap))
	b = binary.AppendUvarint(b, o.QueuedPrefillTokens)
	return append(b, o.OSL), nil
}

func appendKVEvents(b []byte, e *KVEvents) ([]byte, error) {
	if err := checkLen("endpoint", len(e.Endpoint), MaxStringLen); err != nil {
		return b, err
	}
	if err := checkLen("kv-event payload", len(e.Payload), MaxPayload); err != nil {
		return b, err
	}
	b = appendString(b, e.Endpoint)
	b = binary.AppendUvarint(b, uint64(len(e.Payload)))
	b = append(b, e.Payload...)
	return binary.AppendUvarint(b, e.Seq), nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// checkStrings checks the four strings of a Start or an Outcome.
func checkStrings(endpoint, prefixID, tenant, model string) error {
	for _, f := range [...]struct {
		what string
		n    int
	}{{"endpoint", len(endpoint)}, {"prefix id", len(prefixID)}, {"tenant", len(tenant)}, {"model", len(model)}} {
		if err := checkLen(f.what, f.n, MaxStringLen); err != nil {
			return err
		}
	}
	return nil
}

func checkLen(what string, n, limit int) error {
	if n > limit {
		return fmt.Errorf("%w: %s: %d, limit %d", ErrTooLarge, what, n, limit)
	}
	return nil
}

// checkSize stops an encoding early once it is over MaxMessage.
func checkSize(b []byte, start int) error {
	if len(b)-start > MaxMessage {
		return fmt.Errorf("%w: message over %d bytes", ErrTooLarge, MaxMessage)
	}
	return nil
}

// A Start's flags: bit 0 prefilled, bit 1 a prefill endpoint follows.
const (
	flagPrefilled = 1
	flagPrefill   = 2
)
