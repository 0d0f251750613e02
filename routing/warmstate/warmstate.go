// Package warmstate holds the values a kvbandit replica hands a peer that
// starts or restarts (issue 22, the warm start): per endpoint, the state
// of its KV-event stream (the last sequence number applied and whether
// the view is whole) and the KV index entries the events built, with the
// engine-hash → key maps later events name their parents by; the latency
// model's pooled fit and speed factors; the thompson policy's bandits; the
// sessions (routing/prefixstate).
//
// It holds values only, and imports nothing of the module. The owners of
// the state export into these values and import from them (kvindex,
// kvevents, latency, prefixstate, the policies, gathered by the engine);
// routing/sync/wire encodes them in chunks; routing/sync carries them. A
// [Snapshot] is a flat list of records, so that a transfer can be cut
// anywhere between records and a long run of blocks into several runs:
// [Snapshot.Append] puts the pieces back together. Whatever arrives was
// sent by a peer: every importer checks the values it is given against
// its own bounds (a value out of range is refused, counted, never
// trusted).
package warmstate

// Limits every importer and the wire format hold a snapshot to, beside
// the transfer's byte bound.
const (
	// MaxStringLen bounds every string (endpoints, tenants, prefix ids).
	MaxStringLen = 512
	// MaxRank bounds a data-parallel rank.
	MaxRank = 1 << 10
	// MaxBlockSize bounds a block size, in tokens.
	MaxBlockSize = 1 << 16
	// MaxFactor bounds a lower-tier block's GPU blocks.
	MaxFactor = 1 << 10
	// FitDimTTFT and FitDimDecode are the dimensions of the latency
	// model's two fits.
	FitDimTTFT   = 5
	FitDimDecode = 2
	// ArmDim is the dimension of a thompson LinTS arm.
	ArmDim = 9
	// AnyRank, as the rank an importer's endpoint filter is asked about,
	// asks whether the endpoint is in the set at all.
	AnyRank = -2
)

// Media of a block run, as routing/kvindex numbers them.
const (
	MediumGPU  uint8 = 0
	MediumCPU  uint8 = 1
	MediumDisk uint8 = 2
)

// Snapshot is a replica's state, or a piece of it (one chunk of a
// transfer). The zero value is empty.
type Snapshot struct {
	// Streams are the KV-event streams, one per endpoint with a
	// subscriber.
	Streams []Stream
	// Blocks are the event-fed index entries, in runs; one endpoint rank
	// and space may take several runs.
	Blocks []Blocks
	// Latency is the latency model's pooled fit (the kvbandit policy);
	// nil when the policy has none, or in a piece without it.
	Latency *Latency
	// Speeds are the latency model's speed factors.
	Speeds []Speed
	// Arms, Betas and Baselines are the thompson policy's learners.
	Arms      []Arm
	Betas     []Beta
	Baselines *Baselines
	// Sessions are the prefix state's entries.
	Sessions []Session
}

// Append adds part's records to s (a transfer's chunks, in order). The
// records keep their order; a later Latency or Baselines replaces an
// earlier one.
func (s *Snapshot) Append(part *Snapshot) {
	s.Streams = append(s.Streams, part.Streams...)
	s.Blocks = append(s.Blocks, part.Blocks...)
	s.Speeds = append(s.Speeds, part.Speeds...)
	s.Arms = append(s.Arms, part.Arms...)
	s.Betas = append(s.Betas, part.Betas...)
	s.Sessions = append(s.Sessions, part.Sessions...)
	if part.Latency != nil {
		s.Latency = part.Latency
	}
	if part.Baselines != nil {
		s.Baselines = part.Baselines
	}
}

// Empty reports whether s holds no record.
func (s *Snapshot) Empty() bool {
	return len(s.Streams) == 0 && len(s.Blocks) == 0 && s.Latency == nil && len(s.Speeds) == 0 &&
		len(s.Arms) == 0 && len(s.Betas) == 0 && s.Baselines == nil && len(s.Sessions) == 0
}

// BlockCount is the number of blocks over every run.
func (s *Snapshot) BlockCount() int {
	n := 0
	for i := range s.Blocks {
		n += len(s.Blocks[i].Blocks)
	}
	return n
}

// RunsOf returns the block runs of endpoint, in order.
func (s *Snapshot) RunsOf(endpoint string) []Blocks {
	var out []Blocks
	for i := range s.Blocks {
		if s.Blocks[i].Endpoint == endpoint {
			out = append(out, s.Blocks[i])
		}
	}
	return out
}

// Stream is the state of one endpoint's KV-event stream on the exporting
// replica, taken between two messages, with the index entries exported at
// that same point.
type Stream struct {
	Endpoint string
	// Started says the exporter has seen a message of the worker; without
	// it, Seq and Trusted mean nothing.
	Started bool
	// Trusted says the exporter's view of the worker is whole: no message
	// missed since a known state (the worker's first, a clear, a replay).
	Trusted bool
	// Seq is the last message the exporter applied.
	Seq uint64
}

// Blocks is a run of one endpoint rank's event-fed blocks of one medium
// and block size.
type Blocks struct {
	Endpoint string
	// Rank is the endpoint's rank index (0 for a single-rank endpoint).
	Rank int32
	// Medium is MediumGPU, MediumCPU or MediumDisk.
	Medium uint8
	// BlockSize is the blocks' size in tokens.
	BlockSize uint32
	// Factor is, for a lower tier, the GPU blocks one block covers (it is
	// named by the key of its last); 1 on the GPU.
	Factor uint32
	Blocks []Block
}

// Block is one block: the engine's opaque hash (later events name it as a
// parent or remove it) and kvbandit's chained key.
type Block struct {
	Hash, Key uint64
}

// Latency is the latency model's pooled fit (routing/latency).
type Latency struct {
	// Coefficients are, in milliseconds: PerBatch, PerStep, Base,
	// DecodeShare, PerWaiting, DecodeBase, DecodePerRunning.
	Coefficients [7]float64
	// Observations is the outcomes folded into the fit.
	Observations uint64
	// TTFT and Decode are the weighted least-squares sums behind the fit.
	TTFT   Fit
	Decode Fit
}

// Fit is a weighted least-squares accumulator: S is the n×n matrix Σ
// λ^age x xᵀ (row major), XY the vector Σ λ^age x y.
type Fit struct {
	S, XY []float64
}

// Speed is one endpoint rank's speed factor: a Normal belief over its log
// factor.
type Speed struct {
	Endpoint string
	Rank     int32
	// Mean and Precision are the belief's mean and precision.
	Mean, Precision float64
	// Running is the moving average of the sequences running at the
	// exporter's own decisions there.
	Running float64
	// Observations is the outcomes folded in.
	Observations uint32
	// AgeMillis is how long before the export it last learnt (a duration:
	// replicas' clocks are not compared).
	AgeMillis uint32
}

// Arm is one thompson LinTS arm: its ridge regression's A (ArmDim×ArmDim,
// row major) and b.
type Arm struct {
	Endpoint string
	Rank     int32
	Updates  uint64
	A        [ArmDim * ArmDim]float64
	B        [ArmDim]float64
}

// EMA is an exponential moving average and whether it has a value.
type EMA struct {
	V  float64
	OK bool
}

// Beta is one endpoint's thompson Beta bandit and latency baselines.
type Beta struct {
	Endpoint    string
	Alpha, Beta float64
	Rewards     uint64
	LastReward  float64
	// Buckets are the baselines by output-length level, prefill bin and
	// per-token flag ([3][3][2], flattened); Overall by per-token flag.
	Buckets [18]EMA
	Overall [2]EMA
}

// Baselines are thompson's fleet-wide latency baselines, by per-token
// flag.
type Baselines struct {
	Global [2]EMA
}

// Session is one prefix-state entry.
type Session struct {
	Tenant, PrefixID string
	// Total and Processed are the announced and the counted requests.
	Total, Processed int32
	// Pinned says where the session was last routed (the fields below).
	Pinned   bool
	Endpoint string
	Rank     int32
	// DecodeCost, PrefillCost and IATFactor are the costs its pin charges.
	DecodeCost, PrefillCost, IATFactor float64
	// PinAgeMillis is how long before the export it was pinned,
	// IdleMillis since it was last used.
	PinAgeMillis, IdleMillis uint32
}

// Imported counts what an import took and what it left out (already known
// here, for an endpoint not in the set, or out of range: a value out of
// range is never applied).
type Imported struct {
	Latency            bool
	Speeds, Arms       int
	Betas, Sessions    int
	Skipped, Malformed int
}

// Add adds o's counts to i.
func (i *Imported) Add(o Imported) {
	i.Latency = i.Latency || o.Latency
	i.Speeds += o.Speeds
	i.Arms += o.Arms
	i.Betas += o.Betas
	i.Sessions += o.Sessions
	i.Skipped += o.Skipped
	i.Malformed += o.Malformed
}
