package benchcmd

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
	"github.com/kvbandit/kvbandit/routing/sim/trace"
)

// This file holds bench's report: the JSON form (--json), the policies'
// summaries, and the header and table printed on stdout.

// benchReport is the --json output.
type benchReport struct {
	Trace        string    `json:"trace"`
	Format       string    `json:"format"`
	Requests     int       `json:"requests"`
	Workers      int       `json:"workers"`
	SpeedFactors []float64 `json:"speed_factors"`
	RateScale    float64   `json:"rate_scale"`
	// ArrivalJitterSec is --arrival-jitter (0: arrivals as stamped).
	ArrivalJitterSec float64 `json:"arrival_jitter_seconds,omitempty"`
	KVBlocks         int     `json:"kv_blocks_per_worker"`
	BlockSize        int     `json:"block_size"`
	RouterBlockSize  int     `json:"router_block_size"`
	KVEvents         bool    `json:"kv_events"`
	Seed             int64   `json:"seed"`
	// ScrapeIntervalSec is --scrape-interval (0: load after every change);
	// ScrapeAsDeployed is true without the flag: each policy's load comes
	// as often as its deployment scrapes it (scrapeFlag.interval).
	ScrapeIntervalSec float64 `json:"scrape_interval_s,omitempty"`
	ScrapeAsDeployed  bool    `json:"scrape_as_deployed,omitempty"`
	SpeedSchedule     string  `json:"speed_schedule,omitempty"`
	// Replicas, Sync and SyncDelaySec are --replicas, --sync and
	// --sync-delay, with several replicas only (one replica is the run
	// without replicas).
	Replicas     int     `json:"replicas,omitempty"`
	Sync         string  `json:"sync,omitempty"`
	SyncDelaySec float64 `json:"sync_delay_s,omitempty"`
	// Turns: with --sync nats, replicas decide a burst in turn
	// (routing/burst); false with --no-turns.
	Turns bool `json:"turns,omitempty"`
	// CPUBlocks and CPUReloadTokensSec are --cpu-blocks and
	// --cpu-reload-bandwidth, with a CPU tier only.
	CPUBlocks          int     `json:"cpu_blocks_per_worker,omitempty"`
	CPUReloadTokensSec float64 `json:"cpu_reload_tokens_per_s,omitempty"`
	// PrefillWorkers and the rest are --prefill-workers and its flags,
	// with P/D only.
	PrefillWorkers     int             `json:"prefill_workers,omitempty"`
	PDThresholdTokens  int             `json:"pd_threshold_tokens,omitempty"`
	TransferLatencySec float64         `json:"kv_transfer_latency_s,omitempty"`
	TransferGBps       float64         `json:"kv_transfer_gb_per_s,omitempty"`
	KVBytesPerToken    int             `json:"kv_bytes_per_token,omitempty"`
	Bounds             benchBounds     `json:"bounds"`
	Policies           []policySummary `json:"policies"`
}

type benchBounds struct {
	Infinite             float64 `json:"infinite_cache_hit_rate"`
	Finite               float64 `json:"finite_cache_hit_rate"`
	FiniteCapacityTokens int64   `json:"finite_cache_tokens"`
	PromptTokens         int64   `json:"prompt_tokens"`
}

// policySummary is one policy's row; durations are in seconds.
type policySummary struct {
	Policy  string  `json:"policy"`
	Served  int     `json:"served"`
	Failed  int     `json:"failed"`
	TTFTP50 float64 `json:"ttft_p50_s"`
	TTFTP90 float64 `json:"ttft_p90_s"`
	TTFTP99 float64 `json:"ttft_p99_s"`
	E2EP50  float64 `json:"e2e_p50_s"`
	E2EP99  float64 `json:"e2e_p99_s"`
	// ITLP50 and ITLP90 are percentiles of the requests' mean inter-token
	// latency (requests with more than one output token).
	ITLP50 float64 `json:"itl_p50_s"`
	ITLP90 float64 `json:"itl_p90_s"`
	// Disaggregated is the share of served requests whose prefill ran on
	// a prefill worker.
	Disaggregated   float64 `json:"disaggregated,omitempty"`
	OutputTokensSec float64 `json:"output_tokens_per_s"`
	HitRate         float64 `json:"kv_hit_rate"`
	// CPUHitRate is the part of HitRate loaded back from a CPU tier.
	CPUHitRate   float64 `json:"cpu_hit_rate,omitempty"`
	OfFinite     float64 `json:"hit_rate_of_finite_bound"`
	Imbalance    float64 `json:"load_imbalance"`
	DecisionsSec float64 `json:"decisions_per_s"`
	// Objective is the TTFT-objective attainment (--objective-ttft).
	Objective *objectiveSummary `json:"objective,omitempty"`
	// Affinity is the share of requests with a PrefixID hint served by
	// their session's most used worker (0 when no request has one).
	Affinity float64 `json:"session_affinity,omitempty"`
	// PredErr is the p50 absolute error of the predicted TTFT as a share
	// of the actual TTFT p50 (policies that predict: Predicts).
	PredErr  float64 `json:"ttft_prediction_error,omitempty"`
	Predicts bool    `json:"predicts,omitempty"`
	// With several replicas: the requests that entered through each,
	// and, with sync, the sync items and messages (batched over the sync
	// delay) per decision and the items a peer refused.
	EnteredPerReplica   []int   `json:"requests_per_replica,omitempty"`
	ItemsPerDecision    float64 `json:"sync_items_per_decision,omitempty"`
	MessagesPerDecision float64 `json:"sync_messages_per_decision,omitempty"`
	SyncErrors          int     `json:"sync_errors,omitempty"`
	// Turns is the share of decisions that waited for their replica's
	// turn in a burst (routing/burst).
	Turns             float64   `json:"turns,omitempty"`
	SpanSec           float64   `json:"span_s"`
	WallSec           float64   `json:"wall_s"`
	RequestsPerWorker []int     `json:"requests_per_worker"`
	BusyPerWorker     []float64 `json:"busy_s_per_worker"`
}

func summarize(r *sim.Result, reqs []sim.Request, b trace.Bounds) policySummary {
	s := policySummary{Policy: r.Policy, SpanSec: r.Span.Seconds(), WallSec: r.Wall.Seconds()}
	var ttft, e2e []time.Duration
	var out int
	for _, q := range r.Requests {
		if q.Err != "" {
			s.Failed++
			continue
		}
		s.Served++
		ttft = append(ttft, q.TTFT)
		e2e = append(e2e, q.E2E)
		out += q.OutputTokens
	}
	slices.Sort(ttft)
	slices.Sort(e2e)
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = pct(ttft, 50), pct(ttft, 90), pct(ttft, 99)
	s.E2EP50, s.E2EP99 = pct(e2e, 50), pct(e2e, 99)
	if r.Span > 0 {
		s.OutputTokensSec = float64(out) / r.Span.Seconds()
	}
	s.HitRate = r.HitRate()
	s.CPUHitRate = r.CPUHitRate()
	if b.Finite > 0 {
		s.OfFinite = s.HitRate / b.Finite
	}
	var sum, most time.Duration
	for _, w := range r.Workers {
		s.RequestsPerWorker = append(s.RequestsPerWorker, w.Requests)
		s.BusyPerWorker = append(s.BusyPerWorker, w.Busy.Seconds())
		sum += w.Busy
		most = max(most, w.Busy)
	}
	if sum > 0 {
		s.Imbalance = float64(most) / (float64(sum) / float64(len(r.Workers)))
	}
	if r.DecisionTime > 0 {
		s.DecisionsSec = float64(r.Decisions) / r.DecisionTime.Seconds()
	}
	s.Affinity = affinity(r, reqs)
	s.Objective = summarizeObjectives(r, reqs)
	s.PredErr, s.Predicts = predErr(r)
	if r.Replicas > 1 {
		s.EnteredPerReplica = r.Entered
		s.MessagesPerDecision = r.MessagesPerDecision()
		if r.Decisions > 0 {
			s.ItemsPerDecision = float64(r.SyncItems) / float64(r.Decisions)
		}
		s.SyncErrors = r.SyncErrors
		if r.Decisions > 0 {
			s.Turns = float64(r.Held) / float64(r.Decisions)
		}
	}
	return s
}

// affinity is the share of hinted requests served by their prefix group's
// most used worker.
func affinity(r *sim.Result, reqs []sim.Request) float64 {
	counts := map[string]map[int]int{}
	for i, q := range r.Requests {
		if i >= len(reqs) || q.Err != "" || reqs[i].Hints.PrefixID == "" {
			continue
		}
		id := reqs[i].Hints.PrefixID
		if counts[id] == nil {
			counts[id] = map[int]int{}
		}
		counts[id][q.Worker]++
	}
	var top, all int
	for _, byWorker := range counts {
		m := 0
		for _, n := range byWorker {
			all += n
			m = max(m, n)
		}
		top += m
	}
	if all == 0 {
		return 0
	}
	return float64(top) / float64(all)
}

// pct is the nearest-rank percentile of sorted, in seconds.
func pct(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))].Seconds()
}

// printHeader prints what is replayed: the trace, the fleet and the
// cache bounds.
func (rep *benchReport) printHeader(w io.Writer) {
	fmt.Fprintf(w, "trace %s (%s): %d requests, rate scale %g; %d workers (speed %s), %d KV blocks of %d tokens each\n",
		rep.Trace, rep.Format, rep.Requests, rep.RateScale, rep.Workers, fmtSpeeds(rep.SpeedFactors), rep.KVBlocks, rep.BlockSize)
	if rep.Replicas > 1 {
		fmt.Fprintf(w, "%d replicas, sync %s", rep.Replicas, rep.Sync)
		if rep.Sync != "none" {
			fmt.Fprintf(w, " (delay %v)", time.Duration(rep.SyncDelaySec*float64(time.Second)))
			if !rep.Turns {
				fmt.Fprint(w, ", no turns")
			}
		}
		fmt.Fprintln(w)
	}
	if rep.ArrivalJitterSec > 0 {
		fmt.Fprintf(w, "arrivals spread by up to %v of trace time each (--arrival-jitter)\n", time.Duration(rep.ArrivalJitterSec*float64(time.Second)))
	}
	if rep.SpeedSchedule != "" {
		fmt.Fprintf(w, "speed schedule %s\n", rep.SpeedSchedule)
	}
	switch {
	case rep.ScrapeAsDeployed:
		fmt.Fprintf(w, "load scraped as deployed: weighted every %v (GIE's EPP), the others every %v (serve)\n", gieScrapeInterval, serveScrapeInterval)
	case rep.ScrapeIntervalSec > 0:
		fmt.Fprintf(w, "load scraped every %v\n", time.Duration(rep.ScrapeIntervalSec*float64(time.Second)))
	}
	fmt.Fprint(w, rep.tierLine())
	fmt.Fprint(w, rep.pdLine())
	fmt.Fprintf(w, "KV hit-rate bounds: infinite cache %.1f%%, finite cache (one LRU of %d tokens) %.1f%%\n\n",
		100*rep.Bounds.Infinite, rep.Bounds.FiniteCapacityTokens, 100*rep.Bounds.Finite)
}

// printTable prints a row per policy.
func (rep *benchReport) printTable(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	hinted, objectives, predicts := false, false, false
	for _, p := range rep.Policies {
		hinted = hinted || p.Affinity > 0
		objectives = objectives || p.Objective != nil
		predicts = predicts || p.Predicts
	}
	head := "policy\tTTFT p50\tp90\tp99\tE2E p50\tp99\tout tok/s\tKV hit\tof finite\timbalance\tdecisions/s\tfailed\t"
	if hinted {
		head += "affinity\t"
	}
	synced := rep.Replicas > 1 && rep.Sync != "none"
	if synced {
		head += "msgs/decision\t"
		if rep.Turns {
			head += "turns\t"
		}
	}
	if rep.CPUBlocks > 0 {
		head += "cpu hit\t"
	}
	if objectives {
		head += objectiveColumns
	}
	if predicts {
		head += "pred err\t"
	}
	pdRows := rep.PrefillWorkers > 0
	if pdRows {
		head += "ITL p50\tp90\tdisagg\t"
	}
	fmt.Fprintln(tw, head)
	for _, p := range rep.Policies {
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%.1f%%\t%.0f%%\t%.2f\t%.0f\t%d\t",
			p.Policy, fmtSec(p.TTFTP50), fmtSec(p.TTFTP90), fmtSec(p.TTFTP99), fmtSec(p.E2EP50), fmtSec(p.E2EP99),
			p.OutputTokensSec, 100*p.HitRate, 100*p.OfFinite, p.Imbalance, p.DecisionsSec, p.Failed)
		if hinted {
			line += fmt.Sprintf("%.1f%%\t", 100*p.Affinity)
		}
		if synced {
			line += fmt.Sprintf("%.2f\t", p.MessagesPerDecision)
			if rep.Turns {
				line += fmt.Sprintf("%.1f%%\t", 100*p.Turns)
			}
		}
		if rep.CPUBlocks > 0 {
			line += fmt.Sprintf("%.1f%%\t", 100*p.CPUHitRate)
		}
		if objectives {
			line += p.Objective.cells()
		}
		if predicts {
			line += fmtPredErr(p)
		}
		if pdRows {
			line += fmt.Sprintf("%.1fms\t%.1fms\t%.0f%%\t", 1000*p.ITLP50, 1000*p.ITLP90, 100*p.Disaggregated)
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
}

func fmtSec(s float64) string {
	if s < 1 {
		return fmt.Sprintf("%.0fms", s*1000)
	}
	return fmt.Sprintf("%.2fs", s)
}

func fmtSpeeds(f []float64) string {
	if !slices.ContainsFunc(f, func(v float64) bool { return v != 1 }) {
		return "all 1"
	}
	s := make([]string, len(f))
	for i, v := range f {
		s[i] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	return strings.Join(s, ",")
}
