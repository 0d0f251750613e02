package discovery

import (
	"context"

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
