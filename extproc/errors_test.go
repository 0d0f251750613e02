package extproc_test

import (
	"fmt"
	"testing"

	"github.com/kvbandit/kvbandit/extproc"
)

// TestRejectStreamLimits: the stream limits map to the documented statuses,
// wrapped or not.
func TestRejectStreamLimits(t *testing.T) {
	for _, tc := range []struct {
		err    error
		status int
		code   string
	}{
		{extproc.ErrTooManyStreams, 503, "too_many_requests_in_flight"},
		{fmt.Errorf("%w: 1024 in flight", extproc.ErrTooManyStreams), 503, "too_many_requests_in_flight"},
		{fmt.Errorf("%w: more than 32", extproc.ErrTooManyHeaders), 431, "request_headers_too_large"},
		{fmt.Errorf("x: %w", extproc.ErrBufferBudget), 503, "server_busy"},
	} {
		r := extproc.Reject(tc.err)
		if r == nil || r.Status != tc.status || r.Code != tc.code {
			t.Errorf("Reject(%v) = %+v, want %d %s", tc.err, r, tc.status, tc.code)
		}
	}
	// No request to answer: not a rejection.
	if r := extproc.Reject(fmt.Errorf("%w: none within 5s", extproc.ErrHeaderTimeout)); r != nil {
		t.Errorf("a header timeout is not an HTTP rejection: %+v", r)
	}
}
