package discovery

import (
	"context"
	"fmt"
	"strings"

	"github.com/kvbandit/kvbandit/routing"
)

// Static is a fixed set (--endpoints or the config file's endpoints): it
// publishes once and then waits for ctx.
type Static struct {
	Set routing.EndpointSet
}

// Name implements [Source].
func (s Static) Name() string { return s.Set.Source }

// Run implements [Source].
func (s Static) Run(ctx context.Context, sink Sink) error {
	if err := sink.Publish(s.Set); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// ParseEndpointList parses a static "host:port[,host:port...]" list
// (--endpoints). Each host is an IP literal (IPv6 in brackets) or a DNS
// name ([ParseName]); spaces around entries are ignored; an empty list or a
// duplicate is an error. A set with names must go through the dns package
// before the engine sees it.
func ParseEndpointList(list string) (routing.EndpointSet, error) {
	set := routing.EndpointSet{Source: "static"}
	for _, f := range strings.Split(list, ",") {
		if f = strings.TrimSpace(f); f != "" {
			set.Endpoints = append(set.Endpoints, routing.Endpoint{Key: routing.EndpointKey(f)})
		}
	}
	if len(set.Endpoints) == 0 {
		return routing.EndpointSet{}, fmt.Errorf("%w: no endpoints in %q", routing.ErrInvalidEndpointSet, list)
	}
	return set, CheckSet(set.Endpoints)
}
