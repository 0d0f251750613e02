package extproc

import (
	"context"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

// FuzzProcessor drives one stream's processor with an arbitrary sequence of
// ext_proc messages (any order, any modes, hostile headers and bodies) and
// checks the invariants: no panic; replies only of the kinds the message
// allows; once the stream is closed the decision (if any) has ended exactly
// once and no buffer budget is held.
func FuzzProcessor(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5}, []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	f.Add([]byte{0, 2, 2, 7, 3, 4, 4, 5}, []byte(`{"model":"m","prompt":"x"}`))
	f.Add([]byte{3, 0, 1, 1, 6}, []byte(`{"mod`))
	f.Add([]byte{8, 0, 2, 3, 4, 4}, []byte(`not json`))
	f.Add([]byte{9, 0, 1, 2, 3, 5}, []byte(`{"model":"m","messages":[]}`))
	// Request headers without end_of_stream in request_body_mode NONE (op
	// 40) and STREAMED (op 50): decided at the headers, the model from
	// x-gateway-model-name.
	f.Add([]byte{40, 3, 5}, []byte(`m`))
	f.Add([]byte{50, 1, 2, 3, 4, 5}, []byte(`m`))
	f.Fuzz(func(t *testing.T, ops []byte, body []byte) {
		if len(ops) == 0 {
			return
		}
		if len(ops) > 64 {
			ops = ops[:64]
		}
		e := engine.Must(roundrobin.New(), engine.Options{SyncIndex: true}, engine.Deps{Logger: slog.New(slog.DiscardHandler)})
		defer e.Close()
		if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000", Models: []routing.ModelName{"m"}}}}); err != nil {
			t.Fatal(err)
		}
		s := NewServer(Config{MaxBodyBytes: 256, ResponseProcessing: ops[0]%2 == 0}, Deps{Picker: e, Logger: slog.New(slog.DiscardHandler),
			Objectives: fuzzObjectives{}})
		p := newProcessor(s)
		modes := []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_STREAMED}
		for i, op := range ops {
			var m *extprocv3.ProcessingRequest
			chunk := body
			if len(body) > 0 {
				chunk = body[:1+int(op)%len(body)]
			}
			switch op % 10 {
			case 0:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
					EndOfStream: op&0x80 != 0,
					Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
						{Key: ":path", RawValue: []byte([]string{"/v1/chat/completions", "/v1/completions", "/v1/models", "/x"}[int(op>>5)%4])},
						{Key: "x-gateway-destination-endpoint", RawValue: chunk},
						{Key: "x-gateway-destination-endpoint-" + string(chunk), RawValue: chunk},
						{Key: "x-prefix-osl", RawValue: chunk},
						{Key: "x-prefix-" + string(chunk), RawValue: chunk},
						{Key: "x-request-priority", Value: string(chunk)},
						{Key: "x-gateway-inference-objective", RawValue: chunk},
						{Key: "x-request-id", Value: string(chunk)},
						{Key: HeaderModel, RawValue: chunk},
					}},
				}}, ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: modes[int(op>>4)%len(modes)], ResponseBodyMode: modes[int(op>>6)%len(modes)]}}
			case 1, 2:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: op%10 == 2}}}
			case 3:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{EndOfStream: op&0x10 != 0, Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
					{Key: ":status", RawValue: chunk}, {Key: "content-type", RawValue: []byte("text/event-stream")},
				}}}}}
			case 4, 5:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: chunk, EndOfStream: op%10 == 5}}}
			case 6:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
			case 7:
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
			case 8:
				list := []*structpb.Value{structpb.NewStringValue(string(chunk)), structpb.NewStringValue("10.0.0.2:8000")}
				m = &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{}},
					MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
						NamespaceSubset: {Fields: map[string]*structpb.Value{KeySubset: structpb.NewListValue(&structpb.ListValue{Values: list[:int(op>>4)%3]})}},
						NamespaceLB:     {Fields: map[string]*structpb.Value{KeyServed: structpb.NewStringValue(string(chunk))}},
					}}}
			default:
				m = &extprocv3.ProcessingRequest{}
			}
			out, done, err := p.handle(context.Background(), m)
			for _, r := range out {
				if r.GetResponse() == nil {
					t.Fatalf("op %d: empty reply", i)
				}
			}
			if err != nil {
				if Reject(err) != nil {
					p.finishRejected(err)
				} else {
					p.abort(routing.OutcomeReset, "fuzz")
				}
				break
			}
			if done {
				break
			}
		}
		p.close()
		if p.decision != nil && !p.decision.Finished() {
			t.Fatal("decision not ended after close")
		}
		for _, st := range e.Endpoints() {
			if n := st.InFlight.Load(); n != 0 {
				t.Fatalf("%s in-flight %d after close", st.Key, n)
			}
		}
		if n := s.budget.Used(); n != 0 {
			t.Fatalf("buffer budget leaked: %d", n)
		}
		if n := s.InFlight(); n != 0 {
			t.Fatalf("in-flight slot leaked: %d", n)
		}
		if len(p.requestID) > MaxRequestIDBytes || len(p.path) > MaxPathBytes || len(p.spoofed) > MaxSpoofedHeaders {
			t.Fatalf("header bounds exceeded: id %d, path %d, spoofed %d", len(p.requestID), len(p.path), len(p.spoofed))
		}
	})
}

// fuzzObjectives knows every name of even length (priority: its length).
type fuzzObjectives struct{}

func (fuzzObjectives) Priority(name string) (int, bool) { return -len(name), len(name)%2 == 0 }
