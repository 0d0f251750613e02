package envoysim

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// ---- header mutations -------------------------------------------------------

type mutationOp int

const (
	opSet mutationOp = iota
	opAppend
	opRemove
)

// allowedByRules is Envoy's MutationRules Checker with the default
// (empty) HeaderMutationRules; immediate uses the permissive rules of
// immediate responses (allow_all_routing, allow_envoy).
func allowedByRules(op mutationOp, name, value string, immediate bool) bool {
	if op == opRemove && (strings.HasPrefix(name, ":") || name == "host") {
		return false
	}
	if !immediate {
		switch name {
		case "host", ":authority", ":method", ":scheme":
			return false
		}
	}
	if strings.HasPrefix(name, ":") && op == opAppend {
		return false
	}
	if !immediate && strings.HasPrefix(name, "x-envoy") {
		return false
	}
	if op == opRemove {
		return true
	}
	if !strings.HasPrefix(name, ":") && !validHeaderValue(value) {
		return false
	}
	if name == ":status" {
		n, err := strconv.Atoi(value)
		if err != nil || n < 200 {
			return false
		}
	}
	return true
}

// mutate applies a header mutation as MutationUtils::applyHeaderMutations
// does with the filter's default rules. Disallowed changes are ignored (and
// noted); malformed ones fail the whole mutation.
func (ex *exchange) mutate(h *headerMap, hm *extprocv3.HeaderMutation, removeContentLength bool) error {
	for _, name := range hm.GetRemoveHeaders() {
		if !validHeaderName(name) {
			return errors.New("invalid character in remove_headers mutation")
		}
		ln := strings.ToLower(name)
		if !allowedByRules(opRemove, ln, "", false) {
			ex.note(fmt.Sprintf("remove_headers %q ignored by the mutation rules", ln))
			continue
		}
		h.del(ln)
	}
	for _, sh := range hm.GetSetHeaders() {
		hv := sh.GetHeader()
		if hv == nil {
			continue
		}
		if removeContentLength && strings.EqualFold(hv.GetKey(), "content-length") {
			ex.note("set_headers content-length ignored: the body is streamed")
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return errors.New("only one of value or raw_value in the HeaderValue message should be set")
		}
		if hv.GetValue() != "" {
			ex.note(fmt.Sprintf("set_headers %q: value %q ignored, Envoy reads raw_value", hv.GetKey(), hv.GetValue()))
		}
		if sh.GetAppendAction() != corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD {
			ex.note(fmt.Sprintf("set_headers %q: append_action %v ignored, ext_proc reads append", hv.GetKey(), sh.GetAppendAction()))
		}
		value := string(hv.GetRawValue())
		if !validHeaderName(hv.GetKey()) || !validHeaderValue(value) {
			return errors.New("invalid character in set_headers mutation")
		}
		ln := strings.ToLower(hv.GetKey())
		appendValue := sh.GetAppend().GetValue()
		op := opSet
		if _, exists := h.get(ln); appendValue && exists {
			op = opAppend
		}
		if !allowedByRules(op, ln, value, false) {
			ex.note(fmt.Sprintf("set_headers %q ignored by the mutation rules", ln))
			continue
		}
		if appendValue {
			h.add(ln, value)
		} else {
			h.set(ln, value)
		}
	}
	return nil
}

// mutateImmediate applies an ImmediateResponse's headers; failures there
// are only logged by Envoy.
func (ex *exchange) mutateImmediate(h *headerMap, hm *extprocv3.HeaderMutation) {
	for _, name := range hm.GetRemoveHeaders() {
		ln := strings.ToLower(name)
		if validHeaderName(name) && allowedByRules(opRemove, ln, "", true) {
			h.del(ln)
		}
	}
	for _, sh := range hm.GetSetHeaders() {
		hv := sh.GetHeader()
		if hv == nil {
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) == 0 {
			ex.note(fmt.Sprintf("immediate response header %q: value %q ignored, Envoy reads raw_value", hv.GetKey(), hv.GetValue()))
		}
		ln := strings.ToLower(hv.GetKey())
		value := string(hv.GetRawValue())
		appendValue := sh.GetAppend().GetValue()
		op := opSet
		if _, exists := h.get(ln); appendValue && exists {
			op = opAppend
		}
		if !validHeaderName(hv.GetKey()) || !allowedByRules(op, ln, value, true) {
			continue
		}
		if appendValue {
			h.add(ln, value)
		} else {
			h.set(ln, value)
		}
	}
}

func validHeaderName(s string) bool {
	s = strings.TrimPrefix(s, ":")
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

func validHeaderValue(s string) bool {
	return !strings.ContainsAny(s, "\x00\r\n")
}
