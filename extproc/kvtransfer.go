package extproc

import (
	"bytes"

	"github.com/tidwall/gjson"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// FieldKVTransferParams is the request body field through which vLLM's KV
// connectors (NIXL, P2P) are told where to pull a prompt's KV blocks from:
// only a picker (or llm-d's P/D sidecar) may set it, since a client's
// value would make the decode engine connect to a host and engine of the
// client's choosing.
const FieldKVTransferParams = "kv_transfer_params"

// StripsKVTransfer reports whether a request decided as d has its
// client's kv_transfer_params removed: always in a pool with prefill
// endpoints (whether or not this request was disaggregated), and in every
// pool when the operator says so (always).
func StripsKVTransfer(d *routing.Decision, always bool) bool {
	return always || d != nil && d.PD != routing.PDNoPrefillEndpoints
}

// StripKVTransferParams returns body without its top-level
// kv_transfer_params (every copy, however its key is escaped: Python's
// json module, behind vLLM, unescapes keys and keeps the last copy) and
// true, or body itself and false when it has none or is not a JSON
// object. A body that fails openai.CheckJSON (syntax, depth, UTF-8) is
// not read, and returned as is: on the chat and completion paths the
// request parser has already refused it with 400. Every other member is copied byte for byte, so the result is
// shorter than body.
func StripKVTransferParams(body []byte) ([]byte, bool) {
	if len(body) == 0 || openai.CheckJSON(body) != nil {
		return body, false
	}
	lead := len(body) - len(bytes.TrimLeft(body, " \t\r\n"))
	root := gjson.ParseBytes(body[lead:])
	if !root.IsObject() {
		return body, false
	}
	var keep [][2]int // [start, end) of each kept member in body
	found := false
	root.ForEach(func(k, v gjson.Result) bool {
		if k.String() == FieldKVTransferParams {
			found = true
		} else {
			keep = append(keep, [2]int{lead + k.Index, lead + v.Index + len(v.Raw)})
		}
		return true
	})
	if !found {
		return body, false
	}
	out := make([]byte, 0, len(body))
	out = append(out, '{')
	for i, m := range keep {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, body[m[0]:m[1]]...)
	}
	return append(out, '}'), true
}
