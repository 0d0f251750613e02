package proxy_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"
)

// BenchmarkProxy compares a chat request sent straight to a worker with
// the same request through the proxy (parse, estimate tokens, pick, proxy,
// observe the response), both over loopback keep-alive connections; the
// difference is the proxy's overhead. Run with
//
//	go test -run '^$' -bench Proxy -benchmem -count 6 ./extproc/proxy/ | benchstat -
func BenchmarkProxy(b *testing.B) {
	for _, mode := range []struct {
		name   string
		stream bool
	}{{"json", false}, {"sse", true}} {
		extra := ""
		if mode.stream {
			extra = `,"stream":true,"stream_options":{"include_usage":true}`
		}
		body := chatBody("test-model", "benchmark the proxy's overhead on a short chat request", extra)
		f := newFixture(b, options{workers: 2})
		for _, target := range []struct{ name, url string }{
			{"direct", f.workers[0].URL()},
			{"proxy", f.url},
		} {
			b.Run(mode.name+"/"+target.name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, target.url+"/v1/chat/completions", bytes.NewReader(body))
					resp, err := f.client.Do(req)
					if err != nil {
						b.Fatal(err)
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						b.Fatal(resp.Status)
					}
				}
				for _, w := range f.workers {
					w.ClearRequests()
				}
			})
		}
	}
}
