package extproc

import (
	"net/http"
	"strings"

	"github.com/kvbandit/kvbandit/extproc/openai"
)

// Headers read for the path when a data plane sends no :path (NGINX
// Gateway Fabric's endpoint picker shim sends none), in this order, as
// GIE's and llm-d's endpoint pickers read them.
const (
	HeaderOriginalPath  = "x-original-path"
	HeaderForwardedPath = "x-forwarded-path"
)

// pathFallback is what a stream without :path uses instead: the fallback
// headers (each at most MaxPathBytes+1 bytes: classification needs no more)
// and whether the request is to be classified by its body.
type pathFallback struct {
	original, forwarded string
	byBody              bool
}

// resolvePath fills in what a data plane without pseudo-headers leaves out,
// after the headers are read: the path from x-original-path, then
// x-forwarded-path, else (hasBody) the body decides the kind when it
// arrives; and a missing :method is POST when a body follows (a request
// without either stays a header-only request of kind other).
func (p *processor) resolvePath(hasBody bool) {
	if p.path == "" {
		switch {
		case p.fallback.original != "":
			p.path = p.fallback.original
		case p.fallback.forwarded != "":
			p.path = p.fallback.forwarded
		default:
			p.fallback.byBody = hasBody
		}
		p.fallback.original, p.fallback.forwarded = "", ""
	}
	if p.method == "" && hasBody {
		p.method = http.MethodPost
	}
}

// classifyByBody sets the kind (and the path it stands for) of a request
// that came with no path at all, from its body: see [openai.KindOfBody].
// A body that is unseen (request body modes NONE, STREAMED) or empty leaves
// the request of kind other.
func (p *processor) classifyByBody() {
	if !p.fallback.byBody || p.bodyUnseen || len(p.body) == 0 {
		return
	}
	p.fallback.byBody = false
	p.kind = openai.KindOfBody(p.body)
	p.path = p.kind.Path()
}

// lowerName returns a header name in lower case. Envoy sends lower-case
// names (HTTP/2 requires them), and then this does not allocate; other
// data planes send Go's canonical form (X-Prefix-Id).
func lowerName(k string) string {
	for i := 0; i < len(k); i++ {
		if c := k[i]; 'A' <= c && c <= 'Z' {
			return strings.ToLower(k)
		}
	}
	return k
}
