package loopfwd

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestForwardsHTTP: an HTTP server on 127.0.0.1 answers through a
// forwarder on another loopback address, several requests on one
// keep-alive connection, with a streamed body.
func TestForwardsHTTP(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for i := range 3 {
			fmt.Fprintf(w, "chunk %d %s\n", i, r.URL.Path)
			w.(http.Flusher).Flush()
		}
	}))
	defer srv.Close()
	f, err := Listen("127.0.0.3:0", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !strings.HasPrefix(f.Addr(), "127.0.0.3:") {
		t.Fatalf("listening on %s", f.Addr())
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	for i := range 3 {
		resp, err := c.Get(fmt.Sprintf("http://%s/p%d", f.Addr(), i))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := fmt.Sprintf("chunk 0 /p%d\nchunk 1 /p%d\nchunk 2 /p%d\n", i, i, i)
		if string(b) != want {
			t.Fatalf("got %q, want %q", b, want)
		}
	}
}

// TestHalfClose: the client's half-close reaches the target, and the
// target's answer after it still comes back.
func TestHalfClose(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := io.ReadAll(c) // until the client's half-close
		fmt.Fprintf(c, "got %d bytes", len(b))
	}()
	f, err := Listen("127.0.0.4:0", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "hello")
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, _ := bufio.NewReader(c).ReadString(0)
	if line != "got 5 bytes" {
		t.Fatalf("got %q", line)
	}
}

// TestCloseEndsOpenConnections: Close returns with a connection still
// open, and the client sees it end.
func TestCloseEndsOpenConnections(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	f, err := Listen("127.0.0.5:0", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	srvSide := <-accepted
	defer srvSide.Close()
	done := make(chan error, 1)
	go func() { done <- f.Close() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung with a connection open")
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("the client connection is still open")
	}
}

// TestRejectsNonLoopback: the forwarder never listens beyond loopback.
func TestRejectsNonLoopback(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", ":0", "10.0.0.1:0", "example:1"} {
		if f, err := Listen(addr, "127.0.0.1:1"); err == nil {
			f.Close()
			t.Errorf("Listen(%q) accepted a non-loopback address", addr)
		}
	}
}

// TestUnreachableTarget: a connection whose target refuses is closed.
func TestUnreachableTarget(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := l.Addr().String()
	l.Close() // nothing listens there now
	f, err := Listen("127.0.0.6:0", target)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || strings.Contains(err.Error(), "timeout") {
		t.Fatalf("want the connection closed, got %v", err)
	}
}
