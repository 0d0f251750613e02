package discovery

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// Skip reasons (metric labels) for records a source cannot use.
const (
	ReasonMalformed     = "malformed"      // not a JSON object of the record schema
	ReasonUnknownEngine = "unknown_engine" // engine other than vllm or sglang
	ReasonInvalid       = "invalid"        // address or numbers out of range
	ReasonDuplicate     = "duplicate"      // a second record for the same address
)

// MaxRecordBytes bounds one encoded record (an etcd value, a file entry):
// a record within routing's per-endpoint limits is far smaller.
const MaxRecordBytes = 1 << 20

// RecordError is why one record was skipped.
type RecordError struct {
	Reason string
	Err    error
}

func (e *RecordError) Error() string { return e.Reason + ": " + e.Err.Error() }
func (e *RecordError) Unwrap() error { return e.Err }

// DecodeRecord parses one endpoint record: a JSON object with the fields of
// [routing.Endpoint] (address, models, adapters, engine, block_size,
// max_num_batched_tokens, data_parallel_size, weight, labels, metrics_url,
// kv_events, kv_events_bind, kv_events_replay). Unknown fields are ignored
// so that newer writers do not break older readers. The address is
// canonicalised. Errors are *RecordError.
func DecodeRecord(data []byte) (routing.Endpoint, error) {
	if len(data) > MaxRecordBytes {
		return routing.Endpoint{}, &RecordError{ReasonInvalid, fmt.Errorf("record of %d bytes (at most %d)", len(data), MaxRecordBytes)}
	}
	var ep routing.Endpoint
	if err := json.Unmarshal(data, &ep); err != nil {
		return routing.Endpoint{}, &RecordError{ReasonMalformed, err}
	}
	return ep, CheckRecord(&ep)
}

// CheckRecord validates one endpoint on its own and canonicalises its
// address. Errors are *RecordError.
func CheckRecord(ep *routing.Endpoint) error {
	if ep.Key == "" {
		return &RecordError{ReasonMalformed, errors.New("no address")}
	}
	if !slices.Contains(routing.Engines, ep.Engine) {
		return &RecordError{ReasonUnknownEngine, fmt.Errorf("engine %q (want vllm or sglang)", ep.Engine)}
	}
	if ap, err := routing.ParseAddrPort(string(ep.Key)); err == nil {
		ep.Key = routing.EndpointKey(ap.String())
	}
	one := routing.EndpointSet{Endpoints: []routing.Endpoint{*ep}}
	if err := one.Validate(); err != nil {
		return &RecordError{ReasonInvalid, err}
	}
	return nil
}

// SkipReason returns the metric label for err (ReasonInvalid when err is
// not a *RecordError).
func SkipReason(err error) string {
	if re, ok := errors.AsType[*RecordError](err); ok {
		return re.Reason
	}
	return ReasonInvalid
}
