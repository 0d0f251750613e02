package proxy

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/tidwall/gjson"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// RouteResponse is the answer of POST /v1/route.
type RouteResponse struct {
	// Endpoint is the endpoint ("ip:port") the request would be sent to.
	Endpoint string `json:"endpoint"`
	// DPRank is the data-parallel rank, -1 for a single-rank endpoint.
	DPRank int `json:"dp_rank"`
	// Policy is the policy that scored.
	Policy string `json:"policy"`
	// Scores are the per-candidate scores as the policy defines them (the
	// kv-based policies give costs: lower is better; least_loaded negated
	// in-flight counts: higher is better); empty for policies that do not
	// score (round_robin, random); a non-finite score is left out. Keyed by "ip:port", or "ip:port#rank"
	// for data-parallel ranks.
	Scores map[string]float64 `json:"scores"`
	// ScoreOrder says how to read Scores: "lower_is_better" (costs: kv,
	// kvbandit) or "higher_is_better" (least_loaded, thompson, weighted);
	// absent when there are no scores.
	ScoreOrder string `json:"score_order,omitempty"`
	// Predicted is each candidate's predicted time to first token and its
	// parts (wait for the work ahead, prefill of the uncached tokens, delay
	// added to the sequences decoding there), in milliseconds, keyed as
	// Scores; empty for policies that do not predict.
	Predicted map[string]routing.Predicted `json:"predicted,omitempty"`
	// OverlapBlocks is the chosen endpoint's predicted number of cached
	// prefix blocks.
	OverlapBlocks int `json:"overlap_blocks"`
	// Tokens is the prompt length in tokens; Estimated says it comes from
	// the byte estimate rather than the model's tokenizer.
	Tokens    int  `json:"tokens"`
	Estimated bool `json:"estimated"`
	// Prefill is the prefill endpoint when the request would be
	// disaggregated (the x-prefiller-host-port value); PD is the P/D
	// outcome (disaggregated, below_threshold, no_body,
	// no_eligible_prefill). Both are absent for a pool without
	// prefill-role endpoints.
	Prefill string `json:"prefill,omitempty"`
	PD      string `json:"pd,omitempty"`
}

// The values of RouteResponse.ScoreOrder.
const (
	ScoreLowerIsBetter  = "lower_is_better"
	ScoreHigherIsBetter = "higher_is_better"
)

// route answers POST /v1/route through the engine's side-effect-free
// Score. The body is a chat request (it has "messages") or a completion
// request; hints are read as for a proxied request.
func (p *Proxy) route(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		closeUnread(w, r)
		p.fail(w, pathRoute, &extproc.MethodError{Method: r.Method, Path: RoutePath, Allow: http.MethodPost})
		return
	}
	body, err := p.readBody(w, r, time.Now().Add(p.cfg.DecisionTimeout))
	if err != nil {
		closeUnread(w, r)
		p.fail(w, pathRoute, err)
		return
	}
	defer body.release()
	b := body.bytes()
	kind := openai.KindChat
	if !gjson.GetBytes(b, "messages").Exists() && gjson.GetBytes(b, "prompt").Exists() {
		kind = openai.KindCompletion
	}
	req, err := p.build(r.Context(), r, RoutePath, kind, b)
	if err != nil {
		p.fail(w, pathRoute, err)
		return
	}
	d, err := p.engine.Score(r.Context(), &req)
	if err != nil {
		p.fail(w, pathRoute, err)
		return
	}
	out := RouteResponse{Endpoint: string(d.Endpoint), DPRank: d.DPRank, Policy: d.Policy, Scores: make(map[string]float64, len(d.Scores)),
		OverlapBlocks: d.Overlap, Tokens: req.TokenCount, Estimated: req.Estimated, Prefill: string(d.Prefill)}
	if d.PD != routing.PDNoPrefillEndpoints {
		out.PD = d.PD.String()
	}
	if len(d.Scores) > 0 {
		out.ScoreOrder = ScoreLowerIsBetter
		if d.ScoresHigherIsBetter {
			out.ScoreOrder = ScoreHigherIsBetter
		}
	}
	for _, s := range d.Scores {
		if !math.IsNaN(s.Score) && !math.IsInf(s.Score, 0) { // JSON has no infinities
			out.Scores[scoreKey(s)] = s.Score
		}
		if s.Predicted != nil && finite(*s.Predicted) {
			if out.Predicted == nil {
				out.Predicted = make(map[string]routing.Predicted, len(d.Scores))
			}
			out.Predicted[scoreKey(s)] = *s.Predicted
		}
	}
	js, err := json.Marshal(&out)
	if err != nil {
		p.fail(w, pathRoute, fmt.Errorf("encoding scores: %w", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set(HeaderEndpoint, out.Endpoint)
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(js)
	p.metrics.request(pathRoute, http.StatusOK)
}

func scoreKey(s routing.Score) string {
	if s.DPRank < 0 {
		return string(s.Endpoint)
	}
	return string(s.Endpoint) + "#" + strconv.Itoa(s.DPRank)
}

// finite reports whether every part of p can be written as JSON.
func finite(p routing.Predicted) bool {
	for _, v := range [...]float64{p.PredictedTTFTMs, p.WaitMs, p.PrefillMs, p.ImpactMs} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
	}
	return true
}
