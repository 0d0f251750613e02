package envoysim

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// ---- headers -------------------------------------------------------------

// header is one entry of an Envoy header map: lower-case key, raw value.
type header struct{ key, value string }

// headerMap is an ordered header map with repeated keys, like Envoy's.
type headerMap []header

func (h headerMap) get(key string) (string, bool) {
	for _, kv := range h {
		if kv.key == key {
			return kv.value, true
		}
	}
	return "", false
}

func (h *headerMap) add(key, value string) { *h = append(*h, header{key, value}) }

func (h *headerMap) del(key string) {
	*h = slices.DeleteFunc(*h, func(kv header) bool { return kv.key == key })
}

// set replaces every value of key with value, keeping the first position.
func (h *headerMap) set(key, value string) {
	for i, kv := range *h {
		if kv.key == key {
			(*h)[i].value = value
			rest := (*h)[i+1:]
			rest.del(key)
			*h = append((*h)[:i+1], rest...)
			return
		}
	}
	h.add(key, value)
}

func (h headerMap) proto() *corev3.HeaderMap {
	out := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, len(h))}
	for i, kv := range h {
		out.Headers[i] = &corev3.HeaderValue{Key: kv.key, RawValue: []byte(kv.value)}
	}
	return out
}

// connectionHeaders are hop-by-hop headers Envoy's HTTP/1 codec does not
// forward (it writes its own framing).
var connectionHeaders = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true,
	"transfer-encoding": true, "upgrade": true, "host": true,
}

// fromHTTP turns Go headers into a header map (sorted keys, as Go's map
// has no order).
func fromHTTP(hdr http.Header) headerMap {
	keys := make([]string, 0, len(hdr))
	for k := range hdr {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var h headerMap
	for _, k := range keys {
		lk := strings.ToLower(k)
		if connectionHeaders[lk] {
			continue
		}
		for _, v := range hdr[k] {
			h.add(lk, v)
		}
	}
	return h
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	s := hex.EncodeToString(b[:])
	return s[:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:]
}

// requestHeaders builds the request header map as Envoy's HTTP/1 codec and
// connection manager leave it before the ext_proc filter.
func (ex *exchange) requestHeaders() headerMap {
	r := ex.r
	h := headerMap{
		{":authority", r.Host},
		{":path", r.RequestURI},
		{":method", r.Method},
		{":scheme", "http"},
	}
	h = append(h, fromHTTP(r.Header)...)
	for _, name := range ex.p.cfg.StripRequestHeaders {
		h.del(strings.ToLower(name))
	}
	if _, ok := h.get("content-length"); !ok && r.ContentLength > 0 {
		h.add("content-length", strconv.FormatInt(r.ContentLength, 10))
	}
	if _, ok := h.get("x-forwarded-proto"); !ok {
		h.add("x-forwarded-proto", "http")
	}
	rid, ok := h.get("x-request-id")
	if !ok || rid == "" {
		rid = newRequestID()
		h.set("x-request-id", rid)
	}
	ex.rec.RequestID = rid
	return h
}
