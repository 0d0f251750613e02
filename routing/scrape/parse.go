package scrape

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvbandit/kvbandit/routing"
)

// DefaultMaxBody is the body limit Parse and the Scraper use when none is set.
const DefaultMaxBody = 10 << 20

var (
	// ErrTooLarge is returned when a metrics body exceeds its limit.
	ErrTooLarge = errors.New("scrape: metrics body too large")
	// ErrMalformed wraps a text-format parse error.
	ErrMalformed = errors.New("scrape: malformed metrics")
	// ErrNoLoadMetrics is returned when a well-formed body holds none of the
	// vLLM or SGLang load metrics (a wrong port, or not an inference worker).
	ErrNoLoadMetrics = errors.New("scrape: no vLLM or SGLang load metrics")
)

// RankLoad is the load of one data-parallel rank of an endpoint (vLLM's
// "engine" label, or a "dp_rank" label).
type RankLoad struct {
	Rank    int
	Waiting float64
	Running float64
	KVUsage float64
	// Finished is the rank's count of finished requests (see
	// Sample.Finished).
	Finished float64
}

// Sample is one scrape of an endpoint's /metrics.
type Sample struct {
	// Waiting and Running are request counts summed over every series
	// (every model and rank) of the endpoint.
	Waiting float64
	Running float64
	// KVUsage is the fraction of KV cache in use, in [0, 1]: the maximum
	// over the endpoint's series (its most loaded rank).
	KVUsage float64
	// Known is set when the load came from a successful scrape; a stale
	// sample keeps the Known of the last good one.
	Known bool
	// Stale is set by the Scraper when the last good scrape is older than
	// Config.StaleAfter; the load fields are then those of that scrape.
	Stale bool
	// BlockSize and NumGPUBlocks come from vllm:cache_config_info; 0 when
	// not reported.
	BlockSize    int
	NumGPUBlocks int
	// Adapters are the LoRA adapters running or waiting, sorted, from the
	// newest vllm:lora_requests_info series; MaxLoRA is its max_lora.
	Adapters []string
	MaxLoRA  int
	// Finished is the worker's count of requests it finished since it
	// started, summed over every series (finish reasons, models, ranks):
	// vLLM's vllm:request_success_total (llm-d-inference-sim's too),
	// SGLang's sglang:num_requests_total. FinishedKnown is false when the
	// body has none of them. A counter: it only grows, until the worker
	// restarts.
	Finished      float64
	FinishedKnown bool
	// Ranks holds per-rank load, sorted by rank, when the series carry a
	// rank label; nil otherwise.
	Ranks []RankLoad
	// At is when the Scraper took the sample (zero from Parse).
	At time.Time
}

// Load returns the sample as a routing load.
func (s Sample) Load() routing.Load {
	return routing.Load{Waiting: s.Waiting, Running: s.Running, KVUsage: s.KVUsage, Known: s.Known, Stale: s.Stale, KVBlocks: s.NumGPUBlocks,
		Finished: s.Finished, FinishedKnown: s.FinishedKnown}
}

// kind is a load signal a metric name maps to.
type kind int

const (
	kindNone kind = iota
	kindWaiting
	kindRunning
	kindKVUsage
	kindCacheConfig
	kindLoRA
	kindFinished
)

// kinds maps normalised metric names (see normalize) to signals.
var kinds = map[string]kind{
	"vllm_num_requests_waiting": kindWaiting,
	"vllm_num_requests_running": kindRunning,
	"vllm_kv_cache_usage_perc":  kindKVUsage,
	"vllm_gpu_cache_usage_perc": kindKVUsage,
	"vllm_cache_config_info":    kindCacheConfig,
	"vllm_lora_requests_info":   kindLoRA,
	"sglang_num_queue_reqs":     kindWaiting,
	"sglang_num_running_reqs":   kindRunning,
	"sglang_token_usage":        kindKVUsage,
	// Counters of finished requests (normalised: no "_total").
	"vllm_request_success": kindFinished,
	"sglang_num_requests":  kindFinished,
}

// normalize lower-cases a metric name, turns colons into underscores and
// drops a "_total" suffix, so vllm:num_requests_waiting,
// vllm_num_requests_waiting and vllm:num_requests_waiting_total agree.
func normalize(name string) string {
	name = strings.ToLower(strings.ReplaceAll(name, ":", "_"))
	return strings.TrimSuffix(name, "_total")
}

// Bounds of the load series kept from one body: far above what a worker
// exports (a series per model, data-parallel rank and signal), far below
// what would let a body's series cost more memory than its bytes.
const (
	// maxLineBytes bounds one line (vllm:lora_requests_info lists the
	// adapters in a label).
	maxLineBytes = 256 << 10
	// maxLoadSeries bounds the load series of one body.
	maxLoadSeries = 4096
	// maxLoadBytes bounds the bytes of the load series of one body.
	maxLoadBytes = 2 << 20
)

// loadLines streams a text exposition and returns only the lines of the
// load metrics (samples and their # TYPE lines), bounded in count and
// bytes. Other lines are skipped unparsed.
func loadLines(r io.Reader) ([]byte, error) {
	br := bufio.NewReaderSize(r, maxLineBytes)
	var out []byte
	series := 0
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("%w: a line over %d bytes", ErrMalformed, maxLineBytes)
		}
		if len(line) > 0 {
			name, sample, ok := lineMetric(line)
			if !ok {
				return nil, fmt.Errorf("%w: line %.40q is not a sample or comment", ErrMalformed, line)
			}
			if name != "" && kinds[normalize(name)] != kindNone {
				if sample {
					if series++; series > maxLoadSeries {
						return nil, fmt.Errorf("%w: more than %d load series", ErrMalformed, maxLoadSeries)
					}
				}
				if len(out)+len(line)+1 > maxLoadBytes {
					return nil, fmt.Errorf("%w: load series over %d bytes", ErrMalformed, maxLoadBytes)
				}
				out = append(out, line...)
				if line[len(line)-1] != '\n' {
					out = append(out, '\n')
				}
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
	}
}

// lineMetric returns the metric name a line is about and whether it is a
// sample (false for a # TYPE line; "" for other comments and blank lines).
// Names may be bare (name{...} v) or quoted inside the braces ({"name",...}).
// ok is false for a line that cannot be a sample: its bare name is not a
// legal metric name (an HTML page, say).
func lineMetric(line []byte) (name string, sample, ok bool) {
	line = bytes.TrimLeft(line, " \t")
	if len(bytes.TrimRight(line, " \t\r\n")) == 0 {
		return "", false, true
	}
	switch line[0] {
	case '#':
		f := bytes.Fields(line[1:])
		if len(f) >= 2 && string(f[0]) == "TYPE" {
			return string(unquote(f[1])), false, true
		}
		return "", false, true
	case '{':
		rest := bytes.TrimLeft(line[1:], " \t")
		if len(rest) > 0 && rest[0] == '"' {
			if end := bytes.IndexByte(rest[1:], '"'); end >= 0 {
				return string(rest[1 : 1+end]), true, true
			}
		}
		return "", false, false
	}
	end := bytes.IndexAny(line, "{ \t\r\n")
	if end < 0 {
		end = len(line)
	}
	n := line[:end]
	for i, c := range n {
		if !(c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || i > 0 && c >= '0' && c <= '9') {
			return "", false, false
		}
	}
	return string(n), true, true
}

// unquote strips the quotes of a quoted metric name in a comment.
func unquote(b []byte) []byte {
	if len(b) >= 2 && b[0] == '"' && b[len(b)-1] == '"' {
		return b[1 : len(b)-1]
	}
	return b
}

// limitedReader fails with ErrTooLarge once more than n bytes are read.
type limitedReader struct {
	r        io.Reader
	n        int64
	exceeded bool
	err      error // the first read error other than io.EOF
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		// Probe one byte: exactly n bytes is fine, n+1 is not.
		var b [1]byte
		k, err := l.r.Read(b[:])
		if k > 0 {
			l.exceeded = true
			return 0, ErrTooLarge
		}
		return 0, err
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	k, err := l.r.Read(p)
	l.n -= int64(k)
	if err != nil && !errors.Is(err, io.EOF) && l.err == nil {
		l.err = err
	}
	return k, err
}

// Parse reads a Prometheus text exposition (format 0.0.4) of at most limit
// bytes (DefaultMaxBody when limit <= 0) and extracts the load signals of a
// vLLM or SGLang worker.
//
// Names are matched liberally: colon or underscore separators, any case,
// with or without a "_total" suffix. Request counts are summed over every
// label set (models, ranks); KV usage is the maximum. A NaN, infinite or
// negative value is skipped, as if the series were absent; KV usage above 1
// is clamped to 1. The counters of finished requests are summed like the
// request counts (Sample.Finished). Parse never panics; errors wrap ErrTooLarge,
// ErrMalformed, ErrNoLoadMetrics or the reader's own error.
func Parse(r io.Reader, limit int64) (Sample, error) {
	fams, err := loadFamilies(r, limit)
	if err != nil {
		return Sample{}, err
	}
	acc := accumulator{loraTime: math.Inf(-1)}
	for name, mf := range fams {
		k := kinds[normalize(name)]
		if k == kindNone {
			continue
		}
		for _, m := range mf.GetMetric() {
			acc.add(k, m)
		}
	}
	return acc.sample()
}

// loadFamilies reads at most limit bytes (DefaultMaxBody when limit <= 0)
// of r and parses its load series into metric families.
func loadFamilies(r io.Reader, limit int64) (map[string]*dto.MetricFamily, error) {
	if limit <= 0 {
		limit = DefaultMaxBody
	}
	lr := &limitedReader{r: r, n: limit}
	// Only the load series are parsed: a worker's body is mostly other
	// metrics, and parsing every series of a hostile 10 MiB body into
	// metric families takes ~80 MiB of heap per scrape.
	load, ferr := loadLines(lr)
	if lr.exceeded {
		return nil, fmt.Errorf("%w (limit %d bytes)", ErrTooLarge, limit)
	}
	if lr.err != nil {
		return nil, fmt.Errorf("scrape: reading metrics: %w", lr.err)
	}
	if ferr != nil {
		return nil, ferr
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(load))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return fams, nil
}

// accumulator folds the series of a body's load metrics into a Sample.
type accumulator struct {
	s        Sample
	found    bool // a waiting, running or KV usage series was seen
	ranks    map[int]*RankLoad
	loraTime float64 // the value of the newest LoRA series so far
}

// seriesLabels are the labels of a load series that Parse reads.
type seriesLabels struct {
	rank                                            int // -1 when absent or invalid
	blockSize, gpuBlocks, running, waiting, maxLoRA string
}

// labelsOf returns the labels of m that Parse reads.
func labelsOf(m *dto.Metric) seriesLabels {
	l := seriesLabels{rank: -1}
	for _, lp := range m.GetLabel() {
		switch lp.GetName() {
		case "engine", "dp_rank":
			if n, err := strconv.Atoi(lp.GetValue()); err == nil && n >= 0 && n < 1<<16 {
				l.rank = n
			}
		case "block_size":
			l.blockSize = lp.GetValue()
		case "num_gpu_blocks":
			l.gpuBlocks = lp.GetValue()
		case "running_lora_adapters":
			l.running = lp.GetValue()
		case "waiting_lora_adapters":
			l.waiting = lp.GetValue()
		case "max_lora":
			l.maxLoRA = lp.GetValue()
		}
	}
	return l
}

// seriesValue returns the value of a gauge, counter or untyped series; ok
// is false for other types (a histogram or summary under a load name) and
// for a NaN, infinite or negative value.
func seriesValue(m *dto.Metric) (v float64, ok bool) {
	switch {
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		v = m.GetUntyped().GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return 0, false
	}
	return v, true
}

// rank returns the load of rank n, adding it if new.
func (a *accumulator) rank(n int) *RankLoad {
	if a.ranks == nil {
		a.ranks = make(map[int]*RankLoad)
	}
	rl := a.ranks[n]
	if rl == nil {
		rl = &RankLoad{Rank: n}
		a.ranks[n] = rl
	}
	return rl
}

// add folds one series of a metric of kind k.
func (a *accumulator) add(k kind, m *dto.Metric) {
	v, ok := seriesValue(m)
	if !ok {
		return
	}
	l := labelsOf(m)
	s := &a.s
	switch k {
	case kindWaiting:
		a.found = true
		s.Waiting += v
		if l.rank >= 0 {
			a.rank(l.rank).Waiting += v
		}
	case kindRunning:
		a.found = true
		s.Running += v
		if l.rank >= 0 {
			a.rank(l.rank).Running += v
		}
	case kindKVUsage:
		a.found = true
		v = min(v, 1)
		s.KVUsage = max2(s.KVUsage, v)
		if l.rank >= 0 {
			rl := a.rank(l.rank)
			rl.KVUsage = max2(rl.KVUsage, v)
		}
	case kindFinished:
		s.FinishedKnown = true
		s.Finished += v
		if l.rank >= 0 {
			a.rank(l.rank).Finished += v
		}
	case kindCacheConfig:
		if n := atoiPos(l.blockSize); n > 0 {
			s.BlockSize = n
		}
		if n := atoiPos(l.gpuBlocks); n > 0 {
			s.NumGPUBlocks = n
		}
	case kindLoRA:
		// vLLM keeps one series per adapter set seen, valued with
		// the time it was set: the newest wins.
		if v < a.loraTime {
			return
		}
		a.loraTime = v
		s.Adapters = adapters(l.running, l.waiting)
		s.MaxLoRA = atoiPos(l.maxLoRA)
	}
}

// sample returns the folded Sample, or ErrNoLoadMetrics when no waiting,
// running or KV usage series was seen.
func (a *accumulator) sample() (Sample, error) {
	if !a.found {
		return Sample{}, ErrNoLoadMetrics
	}
	s := a.s
	s.Known = true
	if len(a.ranks) > 0 {
		s.Ranks = make([]RankLoad, 0, len(a.ranks))
		for _, rl := range a.ranks {
			s.Ranks = append(s.Ranks, *rl)
		}
		slices.SortFunc(s.Ranks, func(a, b RankLoad) int { return a.Rank - b.Rank })
	}
	return s, nil
}

func max2(a, b float64) float64 {
	if b > a {
		return b
	}
	return a
}

// atoiPos parses a positive int label ("16", or "16.0" as some exporters
// write), returning 0 for anything else.
func atoiPos(s string) int {
	if s == "" {
		return 0
	}
	if n, err := strconv.Atoi(s); err == nil {
		return max(n, 0)
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || !(f > 0) || f > math.MaxInt32 {
		return 0
	}
	return int(f)
}

// adapters merges comma lists of adapter names, sorted and deduplicated;
// names over routing.MaxNameBytes are dropped and at most routing.MaxModels
// are kept (the endpoint keeps them until its next scrape).
func adapters(lists ...string) []string {
	var out []string
	for _, l := range lists {
		for a := range strings.SplitSeq(l, ",") {
			if a = strings.TrimSpace(a); a != "" && len(a) <= routing.MaxNameBytes && len(out) < routing.MaxModels {
				out = append(out, strings.Clone(a))
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}
