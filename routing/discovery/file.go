package discovery

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/routing"
)

// maxFileBytes bounds an endpoints file; a larger one is an error.
const maxFileBytes = 16 << 20

// File is a YAML (or JSON) file of endpoint records, reloaded when its
// contents change. The file holds either a list of records or an object
// with an "endpoints" list; each record has the fields of the etcd record
// schema (see [DecodeRecord]). A record that cannot be used is skipped and
// counted; a file that cannot be read or parsed leaves the last good set in
// place and marks the source degraded until it is fixed. Polling (rather
// than inotify) also follows Kubernetes ConfigMap volumes, which swap a
// symlink.
type File struct {
	// Path is the file to read.
	Path string
	// Interval is how often the file is checked; 0 means one second.
	Interval time.Duration
}

// Name implements [Source].
func (f File) Name() string { return "file" }

// Run implements [Source]. A file missing or unparsable at start is not
// fatal: the source stays degraded (nothing published) until it appears.
func (f File) Run(ctx context.Context, sink Sink) error {
	if f.Path == "" {
		return errors.New("file discovery: no path")
	}
	iv := f.Interval
	if iv <= 0 {
		iv = time.Second
	}
	t := time.NewTicker(iv)
	defer t.Stop()
	var last []byte
	for {
		data, err := readBounded(f.Path)
		switch {
		case err != nil:
			sink.SetDegraded("file", err)
		case last != nil && bytes.Equal(data, last):
			// unchanged
		default:
			set, perr := ParseEndpointsFile(data, sink)
			if perr == nil {
				perr = sink.Publish(set)
			}
			if perr != nil {
				sink.SetDegraded("file", fmt.Errorf("%s: %w", f.Path, perr))
			} else {
				last = data
				sink.SetDegraded("file", nil)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func readBounded(path string) ([]byte, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	var b bytes.Buffer
	if _, err := b.ReadFrom(&limited{fh, maxFileBytes + 1}); err != nil {
		return nil, err
	}
	if b.Len() > maxFileBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxFileBytes)
	}
	return b.Bytes(), nil
}

type limited struct {
	f *os.File
	n int64
}

func (l *limited) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errors.New("file too large")
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.f.Read(p)
	l.n -= int64(n)
	return n, err
}

// ParseEndpointsFile parses an endpoints file (a YAML/JSON list of records
// or {endpoints: [...]}). Records that cannot be used are reported to
// sink.Skipped (when sink is not nil) and left out; an error means the
// file as a whole is unusable.
func ParseEndpointsFile(data []byte, sink Sink) (routing.EndpointSet, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return routing.EndpointSet{}, err
	}
	var raw []json.RawMessage
	if err := json.Unmarshal(js, &raw); err != nil {
		var obj struct {
			Endpoints []json.RawMessage `json:"endpoints"`
		}
		if err2 := json.Unmarshal(js, &obj); err2 != nil || obj.Endpoints == nil {
			return routing.EndpointSet{}, errors.New("want a list of endpoint records or an object with an endpoints list")
		}
		raw = obj.Endpoints
	}
	return BuildSet("file", raw, sink), nil
}

// BuildSet decodes records into a set, skipping (and reporting) records
// that cannot be used and later duplicates of an address.
func BuildSet(source string, records []json.RawMessage, sink Sink) routing.EndpointSet {
	set := routing.EndpointSet{Source: source, Endpoints: make([]routing.Endpoint, 0, len(records))}
	seen := make(map[routing.EndpointKey]bool, len(records))
	for _, r := range records {
		ep, err := DecodeRecord(r)
		if err == nil && seen[ep.Key] {
			err = &RecordError{ReasonDuplicate, fmt.Errorf("address %s listed twice", ep.Key)}
		}
		if err != nil {
			if sink != nil {
				sink.Skipped(source, SkipReason(err))
			}
			continue
		}
		seen[ep.Key] = true
		set.Endpoints = append(set.Endpoints, ep)
	}
	return set
}
