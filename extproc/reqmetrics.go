package extproc

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
)

// Front ends: the values of the frontend label of the request metrics.
const (
	// FrontendExtProc is a request seen on an ext_proc stream.
	FrontendExtProc = "ext_proc"
	// FrontendProxy is a request handled by the standalone proxy
	// (--http-addr).
	FrontendProxy = "proxy"
)

// RequestMetrics are the per-request metrics that both front ends (the
// ext_proc server and the standalone proxy) record, in one set of series
// told apart by the frontend label: kvbandit_requests_total,
// kvbandit_decision_outcomes_total, kvbandit_ttft_seconds and
// kvbandit_request_duration_seconds. Make one per front end with
// [NewRequestMetrics]; the two share the registered collectors.
type RequestMetrics struct {
	requests *prometheus.CounterVec // path, code_class
	outcomes *prometheus.CounterVec // outcome
	ttft     prometheus.Observer
	latency  prometheus.Observer
}

// NewRequestMetrics returns frontend's view of the request metrics on reg
// (a private registry when nil). The collectors are registered by the
// first front end and reused by the second, so the ext_proc server and the
// proxy can be given the same registry in any order. It fails only when
// reg holds different collectors under these names.
func NewRequestMetrics(reg prometheus.Registerer, frontend string) (*RequestMetrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	requests, err := registerShared(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_requests_total",
		Help: "Requests by front end (ext_proc: seen on ext_proc streams; proxy: handled by the standalone proxy), path class and final HTTP status class (local replies included; 'none' when the request ended without a status, e.g. the client went away).",
	}, []string{"frontend", "path", "code_class"}))
	if err != nil {
		return nil, err
	}
	outcomes, err := registerShared(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_decision_outcomes_total",
		Help: "Decisions ended, by front end and outcome.",
	}, []string{"frontend", "outcome"}))
	if err != nil {
		return nil, err
	}
	ttft, err := registerShared(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvbandit_ttft_seconds",
		Help:    "Time from the routing decision to the first response chunk carrying generated content, by front end.",
		Buckets: RequestBuckets,
	}, []string{"frontend"}))
	if err != nil {
		return nil, err
	}
	latency, err := registerShared(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvbandit_request_duration_seconds",
		Help:    "Time from the routing decision to the end of the response, by front end.",
		Buckets: RequestBuckets,
	}, []string{"frontend"}))
	if err != nil {
		return nil, err
	}
	fl := prometheus.Labels{"frontend": frontend}
	m := &RequestMetrics{
		requests: requests.MustCurryWith(fl),
		outcomes: outcomes.MustCurryWith(fl),
		ttft:     ttft.With(fl),
		latency:  latency.With(fl),
	}
	// Pre-create the common series so dashboards see zeros.
	for _, p := range []string{pathChat, pathCompletions, pathModels, PathOther} {
		for _, c := range []string{"2xx", "4xx", "5xx"} {
			m.requests.WithLabelValues(p, c)
		}
	}
	return m, nil
}

// registerShared registers c, or returns the collector of the same
// description already registered.
func registerShared[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	if err != nil {
		var zero C
		return zero, fmt.Errorf("request metrics: %w", err)
	}
	return c, nil
}

// Request counts one request by path class and final status (0: none).
func (m *RequestMetrics) Request(path string, status int) {
	m.requests.WithLabelValues(path, CodeClass(status)).Inc()
}

// Outcome records an ended decision: its outcome, and its TTFT and
// duration when they were measured.
func (m *RequestMetrics) Outcome(o routing.Outcome) {
	m.outcomes.WithLabelValues(o.Kind.String()).Inc()
	if o.TTFT > 0 {
		m.ttft.Observe(o.TTFT.Seconds())
	}
	if o.Latency > 0 {
		m.latency.Observe(o.Latency.Seconds())
	}
}
