package extproc

import (
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/extproc/tracing"
)

// headersResponse answers the request headers; with decided set it carries
// the decision.
func (p *processor) headersResponse(decided bool) *extprocv3.ProcessingResponse {
	r := &headersReply{}
	r.mutation.SetHeaders = r.set[:0]
	r.common.HeaderMutation = p.mutation(&r.mutation)
	r.headers.Response = &r.common
	r.oneof.RequestHeaders = &r.headers
	r.resp.Response = &r.oneof
	if decided {
		r.common.ClearRouteCache = true
		r.resp.DynamicMetadata = p.dynamicMetadata()
	}
	return &r.resp
}

// headersReply is a request headers reply and the messages it points to,
// in one allocation, with room for the destination header and one more.
type headersReply struct {
	resp     extprocv3.ProcessingResponse
	oneof    extprocv3.ProcessingResponse_RequestHeaders
	headers  extprocv3.HeadersResponse
	common   extprocv3.CommonResponse
	mutation extprocv3.HeaderMutation
	set      [2]*corev3.HeaderValueOption
}

// bufferedBodyResponse carries the decision in BUFFERED mode, the body
// untouched unless it was rewritten.
func (p *processor) bufferedBodyResponse() *extprocv3.ProcessingResponse {
	common := &extprocv3.CommonResponse{HeaderMutation: p.mutation(&extprocv3.HeaderMutation{}), ClearRouteCache: true}
	if p.bodyRewritten {
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: p.body}}
	}
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}},
		DynamicMetadata: p.dynamicMetadata(),
	}
}

// mutation sets the destination (when decided) and removes every
// client-supplied header that could steer the data plane.
func (p *processor) mutation(hm *extprocv3.HeaderMutation) *extprocv3.HeaderMutation {
	rank := -1
	if p.decision != nil {
		hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderDestination, p.destination()))
		rank = p.decision.DPRank
		if rank >= 0 {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderDPRank, strconv.Itoa(rank)))
		}
		if pre := p.decision.Prefill; pre != "" {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderPrefiller, string(pre)))
		}
		// Tracing on: the worker's parent is the stream's span.
		if tp, ts := p.span.TraceContext(); tp != "" {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(tracing.HeaderTraceparent, tp))
			if ts != "" {
				hm.SetHeaders = append(hm.SetHeaders, setHeader(tracing.HeaderTracestate, ts))
			} else {
				hm.RemoveHeaders = append(hm.RemoveHeaders, tracing.HeaderTracestate)
			}
		}
	}
	if p.bodyRewritten {
		// As GIE's EPP does when it rewrites a body.
		hm.SetHeaders = append(hm.SetHeaders, setHeader("content-length", strconv.Itoa(len(p.body))))
	}
	for _, k := range p.spoofed {
		lk := strings.ToLower(k)
		if (lk == HeaderDestination && p.decision != nil) || (lk == HeaderDPRank && rank >= 0) || (lk == HeaderPrefiller && p.decision != nil && p.decision.Prefill != "") {
			continue // overwritten above
		}
		hm.RemoveHeaders = append(hm.RemoveHeaders, k)
	}
	return hm
}

// destination is the value of the destination header and metadata.
func (p *processor) destination() string {
	d := p.decision
	if len(d.Fallbacks) == 0 {
		return string(d.Endpoint)
	}
	var b strings.Builder
	b.WriteString(string(d.Endpoint))
	for _, f := range d.Fallbacks {
		b.WriteByte(',')
		b.WriteString(string(f))
	}
	return b.String()
}

func (p *processor) dynamicMetadata() *structpb.Struct {
	m := &lbMetadata{}
	m.destKind.StringValue = p.destination()
	m.dest.Kind = &m.destKind
	m.inner.Fields = map[string]*structpb.Value{HeaderDestination: &m.dest}
	m.lbKind.StructValue = &m.inner
	m.lb.Kind = &m.lbKind
	m.outer.Fields = map[string]*structpb.Value{NamespaceLB: &m.lb}
	return &m.outer
}

// lbMetadata is the decision's dynamic metadata, {NamespaceLB:
// {HeaderDestination: "ip:port"}}, in one allocation besides its maps.
type lbMetadata struct {
	outer, inner structpb.Struct
	lb, dest     structpb.Value
	lbKind       structpb.Value_StructValue
	destKind     structpb.Value_StringValue
}

// appendBodyChunks re-streams body as StreamedBodyResponse chunks of at most
// BodyChunkBytes; the last carries end_of_stream when eos is set. An empty
// body still gets one (empty) chunk.
func appendBodyChunks(out []*extprocv3.ProcessingResponse, body []byte, eos bool) []*extprocv3.ProcessingResponse {
	chunks := make([]bodyChunk, max(1, (len(body)+BodyChunkBytes-1)/BodyChunkBytes))
	for i := range chunks {
		n := min(len(body), BodyChunkBytes)
		out = append(out, chunks[i].set(true, body[:n:n], n == len(body) && eos))
		body = body[n:]
	}
	return out
}
