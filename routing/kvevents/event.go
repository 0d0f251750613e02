package kvevents

import (
	"bytes"
	"fmt"
	"strconv"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Event types.
type evType uint8

const (
	evOther evType = iota
	evStored
	evRemoved
	evCleared
)

// rawEvent holds the fields of one event before it becomes a kvindex.Event.
// Its byte slices alias the payload.
type rawEvent struct {
	typ       evType
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
	blockSize int64
	loraID    int64
	hasLoRAID bool
	loraName  []byte
	medium    []byte
	groupIdx  int64
	specKind  []byte
}

// Field order of msgspec's array_like encoding, after the tag
// (vllm/distributed/kv_events.py).
const (
	fOther = iota
	fBlockHashes
	fParent
	fTokenIDs
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fGroupIdx
	fSpecKind
)

var (
	storedFields  = [...]uint8{fBlockHashes, fParent, fTokenIDs, fBlockSize, fLoRAID, fMedium, fLoRAName, fOther /* extra_keys */, fGroupIdx, fSpecKind, fOther /* kv_cache_spec_sliding_window */}
	removedFields = [...]uint8{fBlockHashes, fMedium, fGroupIdx}
)

func fieldOf(name []byte) uint8 {
	switch string(name) {
	case "block_hashes":
		return fBlockHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokenIDs
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoRAID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoRAName
	case "group_idx":
		return fGroupIdx
	case "kv_cache_spec_kind":
		return fSpecKind
	}
	return fOther
}

func typeOf(tag []byte) evType {
	switch string(tag) {
	case "BlockStored":
		return evStored
	case "BlockRemoved":
		return evRemoved
	case "AllBlocksCleared":
		return evCleared
	}
	return evOther
}

func (dc *decoder) events(b *Batch) error {
	cls, _, err := dc.peek()
	if err != nil {
		return err
	}
	if cls != clsArray {
		return dc.errf("events is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return err
	}
	if n > MaxEventsPerBatch {
		return dc.errf("%d events in one batch, limit %d", n, MaxEventsPerBatch)
	}
	b.Events = make([]kvindex.Event, 0, n)
	for i := range n {
		var ev rawEvent
		if err := dc.event(&ev); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if err := b.add(&ev); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

func (dc *decoder) event(ev *rawEvent) error {
	cls, _, err := dc.peek()
	if err != nil {
		return err
	}
	switch cls {
	case clsArray:
		n, err := dc.length(cls)
		if err != nil {
			return err
		}
		if n < 1 {
			return dc.errf("empty event array")
		}
		tag, err := dc.str("event tag", MaxStringBytes)
		if err != nil {
			return err
		}
		ev.typ = typeOf(tag)
		var names []uint8
		switch ev.typ {
		case evStored:
			names = storedFields[:]
		case evRemoved:
			names = removedFields[:]
		}
		for i := 1; i < n; i++ {
			f := uint8(fOther)
			if i-1 < len(names) {
				f = names[i-1]
			}
			if err := dc.field(ev, f); err != nil {
				return err
			}
		}
		return nil
	case clsMap:
		n, err := dc.length(cls)
		if err != nil {
			return err
		}
		for range n {
			k, err := dc.str("map key", MaxStringBytes)
			if err != nil {
				return err
			}
			if string(k) == "type" {
				tag, err := dc.str("event type", MaxStringBytes)
				if err != nil {
					return err
				}
				ev.typ = typeOf(tag)
				continue
			}
			if err := dc.field(ev, fieldOf(k)); err != nil {
				return err
			}
		}
		return nil
	}
	return dc.errf("event is neither an array nor a map")
}

func (dc *decoder) field(ev *rawEvent, f uint8) error {
	var err error
	switch f {
	case fBlockHashes:
		ev.hashes, err = dc.hashes()
	case fParent:
		ev.parent, ev.hasParent, err = dc.hash()
	case fTokenIDs:
		ev.tokens, err = dc.tokenIDs()
	case fBlockSize:
		ev.blockSize, _, err = dc.optInt()
	case fLoRAID:
		ev.loraID, ev.hasLoRAID, err = dc.optInt()
	case fMedium:
		ev.medium, err = dc.optString("medium")
	case fLoRAName:
		ev.loraName, err = dc.optString("lora_name")
	case fGroupIdx:
		ev.groupIdx, _, err = dc.optInt()
	case fSpecKind:
		ev.specKind, err = dc.optString("kv_cache_spec_kind")
	default:
		err = dc.skip(1)
	}
	return err
}

// mainGroup reports whether an event belongs to the main (full or MLA
// attention, group 0) KV cache group.
func (ev *rawEvent) mainGroup() bool {
	if ev.groupIdx != 0 {
		return false
	}
	k := ev.specKind
	return len(k) == 0 || containsFold(k, "full") || containsFold(k, "mla")
}

// containsFold reports whether s contains the lower-case ASCII word sub,
// ignoring ASCII case.
func containsFold(s []byte, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if bytes.EqualFold(s[i:i+len(sub)], []byte(sub)) {
			return true
		}
	}
	return false
}

// mediumOf maps an event's medium string to a tier, ignoring ASCII case;
// ok is false for media kvbandit does not score (remote or shared stores).
// The strings are those publishers send: vLLM "GPU" (nil when offloading is
// off) and its OffloadingConnector's "CPU"; SGLang HiCache and Dynamo KVBM
// "CPU_TIER1" (host memory) and "CPU_TIER2" (disk); llm-d's lower-case
// "gpu", "cpu"; "DEVICE", "CPU_PINNED", "DISK", "NVME" and "STORAGE" as other
// routers read them.
func mediumOf(m []byte) (kvindex.Medium, bool) {
	if len(m) == 0 {
		return kvindex.MediumGPU, true
	}
	for _, c := range mediumNames {
		if bytes.EqualFold(m, []byte(c.name)) {
			return c.medium, true
		}
	}
	return 0, false
}

var mediumNames = [...]struct {
	name   string
	medium kvindex.Medium
}{
	{"GPU", kvindex.MediumGPU},
	{"DEVICE", kvindex.MediumGPU},
	{"CPU", kvindex.MediumCPU},
	{"CPU_TIER1", kvindex.MediumCPU},
	{"CPU_PINNED", kvindex.MediumCPU},
	{"CPU_TIER2", kvindex.MediumDisk},
	{"DISK", kvindex.MediumDisk},
	{"NVME", kvindex.MediumDisk},
	{"STORAGE", kvindex.MediumDisk},
}

func (b *Batch) add(ev *rawEvent) error {
	switch ev.typ {
	case evCleared:
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Cleared})
		return nil
	case evRemoved:
		m, ok := mediumOf(ev.medium)
		if !ev.mainGroup() || !ok {
			b.Ignored++
			return nil
		}
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Removed, RemovedHashes: ev.hashes, Medium: m})
		return nil
	case evStored:
	default:
		b.Ignored++
		return nil
	}
	m, ok := mediumOf(ev.medium)
	if !ev.mainGroup() || !ok {
		b.Ignored++
		return nil
	}
	if m != kvindex.MediumGPU && len(ev.tokens) == 0 {
		// Location only: vLLM's OffloadingConnector names offloaded blocks
		// by their GPU block hashes, with no tokens, no parent and a block
		// size of 0 (newer vLLM) or the offloaded block size.
		if ev.blockSize < 0 || ev.blockSize > maxBlockSize {
			return fmt.Errorf("%w: block_size %d", ErrMalformed, ev.blockSize)
		}
		out := kvindex.Event{Kind: kvindex.Stored, BlockSize: int(ev.blockSize), Medium: m, Blocks: make([]kvindex.StoredBlock, len(ev.hashes))}
		for i, h := range ev.hashes {
			out.Blocks[i] = kvindex.StoredBlock{EngineHash: h}
		}
		b.Events = append(b.Events, out)
		b.Blocks += len(ev.hashes)
		return nil
	}
	if ev.blockSize <= 0 || ev.blockSize > maxBlockSize {
		return fmt.Errorf("%w: block_size %d", ErrMalformed, ev.blockSize)
	}
	bs := int(ev.blockSize)
	if len(ev.tokens) != len(ev.hashes)*bs {
		return fmt.Errorf("%w: %w (%w): %d token ids for %d blocks of %d",
			ErrMalformed, ErrTokenCount, kvindex.ErrBlockSize, len(ev.tokens), len(ev.hashes), bs)
	}
	out := kvindex.Event{
		Kind:      kvindex.Stored,
		BlockSize: bs,
		// A parent of 0 means none: llm-d-inference-sim (and llm-d's
		// adapters) send 0 for a first block in the array encoding, where
		// vLLM sends nil; a real hash of 0 has probability 2^-64.
		HasParent: ev.hasParent && ev.parent != 0,
		Parent:    ev.parent,
		LoRA:      string(ev.loraName),
		Blocks:    make([]kvindex.StoredBlock, len(ev.hashes)),
		Medium:    m,
	}
	if out.LoRA == "" && ev.hasLoRAID {
		// Old vLLM sends only the adapter's integer id.
		out.LoRA = strconv.FormatInt(ev.loraID, 10)
	}
	for i, h := range ev.hashes {
		out.Blocks[i] = kvindex.StoredBlock{EngineHash: h, Tokens: ev.tokens[i*bs : (i+1)*bs : (i+1)*bs]}
	}
	b.Events = append(b.Events, out)
	b.Blocks += len(ev.hashes)
	return nil
}
