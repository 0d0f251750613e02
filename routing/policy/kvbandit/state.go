package kvbandit

import (
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's side of the policy (issue 22): the
// latency model and the sessions exported for a peer replica that starts,
// and imported from one.

// sessionState is the part of a Prefixes that can hand its sessions over
// (FromStore's does).
type sessionState interface {
	exportSessions() []warmstate.Session
	importSessions([]warmstate.Session) (imported, skipped, malformed int)
}

func (p storePrefixes) exportSessions() []warmstate.Session { return p.s.Export(0) }

func (p storePrefixes) importSessions(in []warmstate.Session) (int, int, int) { return p.s.Import(in) }

// ExportState implements the engine's state export (engine.StatefulPolicy):
// the latency model's fit and speed factors, and the sessions.
func (p *Policy) ExportState(dst *warmstate.Snapshot, now time.Time) {
	p.model.ExportState(dst, now)
	if ss, ok := p.prefixes.(sessionState); ok {
		dst.Sessions = append(dst.Sessions, ss.exportSessions()...)
	}
}

// ImportState implements the engine's state import (engine.StatefulPolicy):
// see latency.Model.ImportState and prefixstate.Store.Import.
func (p *Policy) ImportState(src *warmstate.Snapshot, now time.Time, known func(routing.EndpointKey, int) bool) warmstate.Imported {
	out := p.model.ImportState(src, now, known)
	if ss, ok := p.prefixes.(sessionState); ok {
		n, skipped, bad := ss.importSessions(src.Sessions)
		out.Sessions, out.Skipped, out.Malformed = n, out.Skipped+skipped, out.Malformed+bad
	}
	return out
}
