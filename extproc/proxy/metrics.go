package proxy

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
)

// metrics are the proxy's Prometheus metrics (kvbandit_proxy_*). Label
// values come from bounded sets defined here.
type metrics struct {
	requests       *prometheus.CounterVec
	upstreamErrors *prometheus.CounterVec
	outcomes       *prometheus.CounterVec
	ttft           prometheus.Histogram
	hintProblems   prometheus.Counter
	// inferenceObjectives: requests naming an InferenceObjective without
	// a priority of their own, by result (found, unknown).
	inferenceObjectives *prometheus.CounterVec
	tokenizerFallbacks  *prometheus.CounterVec
	tokensRouted        prometheus.Counter
}

// pathRoute is the label of /v1/route; the other path classes are the
// ext_proc server's (extproc.PathClass).
const pathRoute = "route"

func newMetrics(reg prometheus.Registerer, inflight func() float64) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_requests_total",
			Help: "Requests handled by the standalone proxy (--http-addr), by path class and the HTTP status class the client got ('none' when the client went away first).",
		}, []string{"path", "code_class"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_upstream_errors_total",
			Help: "Proxied requests that failed at the worker, by reason: connect (unreachable, answered 503), status (an error status), body (the response broke off).",
		}, []string{"reason"}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_decision_outcomes_total",
			Help: "Decisions of proxied requests ended, by outcome.",
		}, []string{"outcome"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvbandit_proxy_ttft_seconds",
			Help:    "Proxied requests: time from the routing decision to the first response chunk carrying generated content.",
			Buckets: extproc.RequestBuckets,
		}),
		hintProblems: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_proxy_hint_problems_total",
			Help: "Proxied requests: routing hint values that were invalid and ignored.",
		}),
		inferenceObjectives: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_inference_objective_requests_total",
			Help: "Proxied requests that named an InferenceObjective (x-gateway-inference-objective) and gave no priority of their own, by result: found (its priority applied) or unknown (default priority, as GIE).",
		}, []string{"result"}),
		tokenizerFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_tokenizer_fallbacks_total",
			Help: "Proxied requests routed on the byte-based token estimate, by reason (no_tokenizer, error, timeout).",
		}, []string{"reason"}),
		tokensRouted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_proxy_prompt_tokens_routed_total",
			Help: "Prompt tokens of proxied requests as kvbandit tokenized or estimated them.",
		}),
	}
	reg.MustRegister(m.requests, m.upstreamErrors, m.outcomes, m.ttft, m.hintProblems, m.inferenceObjectives, m.tokenizerFallbacks, m.tokensRouted,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbandit_proxy_requests_inflight",
			Help: "Requests the standalone proxy is handling.",
		}, inflight))
	return m
}

func (m *metrics) request(path string, status int) {
	m.requests.WithLabelValues(path, extproc.CodeClass(status)).Inc()
}
