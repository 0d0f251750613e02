package extproc

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc/openai"
)

// Metrics are the ext_proc layer's Prometheus metrics. Label values come
// only from bounded sets: path classes, status classes, phases and reasons
// defined in this package.
type Metrics struct {
	// req are the request metrics shared with the standalone proxy
	// (frontend="ext_proc").
	req              *RequestMetrics
	streamErrors     *prometheus.CounterVec
	streams          prometheus.Gauge
	requestsInflight prometheus.Gauge
	withoutBody      *prometheus.CounterVec
	phase            *prometheus.HistogramVec
	tokens           *prometheus.CounterVec
	servedMismatch   prometheus.Counter
	hintProblems     prometheus.Counter
	// inferenceObjectives counts requests that named an InferenceObjective,
	// by result (found, unknown).
	inferenceObjectives *prometheus.CounterVec
	// clientPriorities counts client priorities capped or ignored.
	clientPriorities   *prometheus.CounterVec
	bufferedBytes      prometheus.GaugeFunc
	tokenizerFallbacks *prometheus.CounterVec

	// Per-phase observers, resolved once (no label lookup per request).
	phaseParse, phaseTokenize, phasePick, phaseTotal prometheus.Observer
	tokensRouted                                     prometheus.Counter
}

var latencyBuckets = []float64{.00005, .0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

// RequestBuckets are the histogram buckets (seconds) of whole-request
// timings (TTFT, request duration), shared with the standalone proxy.
var RequestBuckets = []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// NewMetrics registers the metrics with reg (a private registry when nil).
// bufferedBytes reports the bytes buffered across streams.
func NewMetrics(reg prometheus.Registerer, bufferedBytes func() float64) *Metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &Metrics{
		streamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_extproc_stream_errors_total",
			Help: "ext_proc streams that ended abnormally, by reason.",
		}, []string{"reason"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbandit_extproc_streams_inflight",
			Help: "Open ext_proc streams, including those that have not sent request headers yet.",
		}),
		requestsInflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbandit_extproc_requests_inflight",
			Help: "Requests admitted at their request headers and not finished: what --max-inflight bounds.",
		}),
		withoutBody: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_decisions_without_body_total",
			Help: "Requests with a body decided at the request headers because the data plane's request_body_mode does not show the body first: no model (unless x-gateway-model-name), no prompt, no KV-cache overlap; by reason (request_body_mode_none, request_body_mode_streamed).",
		}, []string{"reason"}),
		phase: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvbandit_phase_duration_seconds",
			Help:    "Time spent per request-path phase: parse, tokenize, pick, and total (last request byte to decision sent).",
			Buckets: latencyBuckets,
		}, []string{"phase"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_tokens_total",
			Help: "Tokens by kind: prompt_routed (what kvbandit tokenized or estimated), prompt, completion and cached (as workers reported in usage).",
		}, []string{"kind"}),
		servedMismatch: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_served_mismatch_total",
			Help: "Responses whose served endpoint (x-gateway-destination-endpoint-served) differs from the chosen one: the data plane fell back.",
		}),
		hintProblems: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_hint_problems_total",
			Help: "Routing hint values that were invalid and ignored.",
		}),
	}
	m.inferenceObjectives = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_inference_objective_requests_total",
		Help: "Requests that named an InferenceObjective (x-gateway-inference-objective), by result: found (its priority applied, as the request's or, under --client-priority cap, as the ceiling of the client's) or unknown (default priority, as GIE).",
	}, []string{"result"})
	m.clientPriorities = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_client_priorities_total",
		Help: "Requests whose own priority (x-request-priority, nvext.agent_hints priority or latency_sensitivity) the operator's policy changed, by action (--client-priority): capped (lowered to the objective's priority or router.client_priority_max) or ignored.",
	}, []string{"action"})
	m.tokenizerFallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_tokenizer_fallbacks_total",
		Help: "Requests routed on the byte-based token estimate instead of the model's tokenizer, by reason (no_tokenizer, error, timeout).",
	}, []string{"reason"})
	cs := []prometheus.Collector{m.tokenizerFallbacks, m.streamErrors, m.streams, m.requestsInflight, m.withoutBody, m.phase, m.tokens, m.servedMismatch, m.hintProblems, m.inferenceObjectives, m.clientPriorities}
	if bufferedBytes != nil {
		m.bufferedBytes = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbandit_buffered_body_bytes",
			Help: "Request body bytes buffered at once by the ext_proc streams and the standalone proxy together (the --max-buffered-bytes budget).",
		}, bufferedBytes)
		cs = append(cs, m.bufferedBytes)
	}
	for _, c := range cs {
		reg.MustRegister(c)
	}
	m.phaseParse = m.phase.WithLabelValues("parse")
	m.phaseTokenize = m.phase.WithLabelValues("tokenize")
	m.phasePick = m.phase.WithLabelValues("pick")
	m.phaseTotal = m.phase.WithLabelValues("total")
	m.tokensRouted = m.tokens.WithLabelValues("prompt_routed")
	req, err := NewRequestMetrics(reg, FrontendExtProc)
	if err != nil {
		panic(err) // as MustRegister above: a conflicting registry is a programming error
	}
	m.req = req
	return m
}

// Path classes for labels.
const (
	pathChat        = "chat_completions"
	pathCompletions = "completions"
	pathModels      = "models"
	// PathOther is the class of every path that is not an OpenAI
	// completion or /v1/models.
	PathOther = "other"
)

// PathClass is the path label of a request: its OpenAI kind, /v1/models,
// or other (decided on the cleaned path, [openai.CleanPath]).
func PathClass(k openai.Kind, path string) string {
	switch k {
	case openai.KindChat:
		return pathChat
	case openai.KindCompletion:
		return pathCompletions
	}
	path, _, _ = strings.Cut(path, "?")
	if clean, err := openai.CleanPath(path); err == nil && clean == "/v1/models" {
		return pathModels
	}
	return PathOther
}

// CodeClass is the status-class label of an HTTP status ("none" for 0).
func CodeClass(status int) string {
	switch {
	case status == 0:
		return "none"
	case status < 200:
		return "1xx"
	case status < 300:
		return "2xx"
	case status < 400:
		return "3xx"
	case status < 500:
		return "4xx"
	}
	return "5xx"
}
