package proxy

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
)

// metrics are the proxy's Prometheus metrics: the request metrics shared
// with the ext_proc server (frontend="proxy") and the proxy's own
// (kvbandit_proxy_*). Label values come from bounded sets defined here.
type metrics struct {
	req            *extproc.RequestMetrics
	upstreamErrors *prometheus.CounterVec
	hintProblems   prometheus.Counter
	// inferenceObjectives: requests naming an InferenceObjective, by
	// result (found, unknown).
	inferenceObjectives *prometheus.CounterVec
	// clientPriorities: client priorities capped or ignored, by action.
	clientPriorities   *prometheus.CounterVec
	tokenizerFallbacks *prometheus.CounterVec
	tokensRouted       prometheus.Counter
	// pdFallbacks: direct-mode prefill stages that failed, the request
	// then served aggregated, by reason.
	pdFallbacks *prometheus.CounterVec
}

// pathRoute is the label of /v1/route; the other path classes are the
// ext_proc server's (extproc.PathClass).
const pathRoute = "route"

func newMetrics(reg prometheus.Registerer, inflight func() float64) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	req, err := extproc.NewRequestMetrics(reg, extproc.FrontendProxy)
	if err != nil {
		panic(err) // as MustRegister below: a conflicting registry is a programming error
	}
	m := &metrics{
		req: req,
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_upstream_errors_total",
			Help: "Proxied requests that failed at the worker, by reason: connect (unreachable, answered 503), status (an error status), body (the response broke off).",
		}, []string{"reason"}),
		hintProblems: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_proxy_hint_problems_total",
			Help: "Proxied requests: routing hint values that were invalid and ignored.",
		}),
		inferenceObjectives: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_inference_objective_requests_total",
			Help: "Proxied requests that named an InferenceObjective (x-gateway-inference-objective), by result: found (its priority applied, as the request's or, under --client-priority cap, as the ceiling of the client's) or unknown (default priority, as GIE).",
		}, []string{"result"}),
		clientPriorities: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_client_priorities_total",
			Help: "Proxied requests whose own priority (x-request-priority, nvext.agent_hints priority or latency_sensitivity) the operator's policy changed, by action (--client-priority): capped (lowered to the objective's priority or router.client_priority_max) or ignored.",
		}, []string{"action"}),
		tokenizerFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_tokenizer_fallbacks_total",
			Help: "Proxied requests routed on the byte-based token estimate, by reason (no_tokenizer, error, timeout).",
		}, []string{"reason"}),
		tokensRouted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_proxy_prompt_tokens_routed_total",
			Help: "Prompt tokens of proxied requests as kvbandit tokenized or estimated them.",
		}),
		pdFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_proxy_pd_fallbacks_total",
			Help: "Disaggregated requests whose prefill stage the proxy ran (--pd-proxy-mode direct) and that failed, then served aggregated on the decode endpoint, by reason: connect, timeout, status, too_large, bad_json, no_kv_transfer_params, bad_request_body, buffer_budget.",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.pdFallbacks, m.upstreamErrors, m.hintProblems, m.inferenceObjectives, m.clientPriorities, m.tokenizerFallbacks, m.tokensRouted,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvbandit_proxy_requests_inflight",
			Help: "Requests the standalone proxy is handling.",
		}, inflight))
	return m
}

func (m *metrics) request(path string, status int) {
	m.req.Request(path, status)
}
