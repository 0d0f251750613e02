package openai

import (
	"bytes"

	"github.com/tidwall/gjson"
)

// DefaultMaxEvent is the event size limit of a StreamParser made with a
// limit of 0 or less (and of the zero StreamParser).
const DefaultMaxEvent = 1 << 20

// keepBuf is the largest event buffer a StreamParser keeps between events;
// a larger one is dropped after its event, so one big event does not pin
// memory for the rest of a long stream.
const keepBuf = 64 << 10

type lineState uint8

const (
	lineStart      lineState = iota // nothing of the current line read yet
	lineName                        // reading a field name that may be "data"
	lineValueStart                  // right after "data:"
	lineValue                       // in a data value
	lineSkip                        // in a line whose field is ignored
)

// StreamParser follows a server-sent-events response (stream: true) as it
// passes through the proxy.
//
// It implements the parts of the SSE format (WHATWG HTML, "server-sent
// events") that OpenAI streams use: lines end in "\n", "\r\n" or "\r"; an
// event ends at a blank line; only "data" fields count (one leading space
// of the value is dropped, several data lines are joined with "\n"); comments
// (":...") and other fields are ignored; an event whose data is empty is not
// an event. An event still open when the stream ends is discarded, as the
// format requires. A data value of "[DONE]" ends the stream; every other
// event should be a JSON object.
//
// Results do not depend on how the stream is cut into chunks. Memory is
// bounded: the event being read is buffered up to the limit given to
// NewStreamParser; a larger event is dropped and counted by Oversized.
//
// The zero value is ready to use with DefaultMaxEvent. A StreamParser is not
// safe for concurrent use.
type StreamParser struct {
	max int

	// Line and event state.
	state     lineState
	afterCR   bool // the last byte was '\r': a '\n' next is part of it
	name      int  // bytes of "data" matched so far in lineName
	buf       []byte
	dataLines int
	oversized bool

	// Results.
	events, oversizedN, malformed int
	done, content, failed         bool
	usage                         Usage
	hasUsage                      bool
}

// NewStreamParser returns a parser that skips events whose data is larger
// than maxEvent bytes; maxEvent <= 0 means DefaultMaxEvent.
func NewStreamParser(maxEvent int) *StreamParser {
	return &StreamParser{max: maxEvent}
}

// Feed consumes the next chunk of the response body. Chunks may be cut
// anywhere, even between the "\r" and "\n" of a line end.
//
// It returns true exactly once per stream: on the call whose chunk completes
// the first event that carries generated content. That is a chat chunk with
// a non-empty choices[].delta.content, delta.reasoning_content or
// delta.reasoning, or with delta.tool_calls (non-null and not empty), or a
// completion chunk with a non-empty choices[].text. The caller takes the
// time to first token from it.
func (p *StreamParser) Feed(chunk []byte) (firstContent bool) {
	for i := 0; i < len(chunk); {
		c := chunk[i]
		if p.afterCR {
			p.afterCR = false
			if c == '\n' {
				i++
				continue
			}
		}
		switch p.state {
		case lineValue, lineSkip:
			j := indexEOL(chunk[i:])
			if j < 0 {
				if p.state == lineValue {
					p.appendData(chunk[i:])
				}
				return firstContent
			}
			if p.state == lineValue {
				p.appendData(chunk[i : i+j])
			}
			i += j
			c = chunk[i]
		case lineValueStart:
			p.state = lineValue
			if c == ' ' {
				i++
				continue
			}
			if c != '\r' && c != '\n' {
				continue // read the value from this byte on
			}
		case lineStart, lineName:
			if c == '\r' || c == '\n' {
				break
			}
			if p.state == lineStart {
				p.state, p.name = lineName, 0
			}
			switch {
			case c == ':' && p.name == len("data"):
				p.beginData()
				p.state = lineValueStart
			case p.name < len("data") && c == "data"[p.name]:
				p.name++
			default:
				p.state = lineSkip // a comment or another field
			}
			i++
			continue
		}
		// c is a line end.
		if p.endLine() {
			firstContent = true
		}
		p.afterCR = c == '\r'
		i++
	}
	return firstContent
}

// indexEOL returns the index of the first '\r' or '\n' in b, or -1.
func indexEOL(b []byte) int {
	j := bytes.IndexByte(b, '\n')
	seg := b
	if j >= 0 {
		seg = b[:j]
	}
	if k := bytes.IndexByte(seg, '\r'); k >= 0 {
		return k
	}
	return j
}

// endLine ends the current line and reports whether it completed the first
// content event.
func (p *StreamParser) endLine() bool {
	st := p.state
	p.state = lineStart
	switch st {
	case lineStart:
		return p.dispatch()
	case lineName:
		if p.name == len("data") {
			p.beginData() // "data" alone is a data line with an empty value
		}
	}
	return false
}

func (p *StreamParser) beginData() {
	if p.dataLines > 0 {
		p.appendData([]byte{'\n'})
	}
	p.dataLines++
}

func (p *StreamParser) limit() int {
	if p.max <= 0 {
		return DefaultMaxEvent
	}
	return p.max
}

func (p *StreamParser) appendData(b []byte) {
	if p.oversized || len(b) == 0 {
		return
	}
	if len(p.buf)+len(b) > p.limit() {
		p.oversized = true
		p.resetBuf()
		return
	}
	p.buf = append(p.buf, b...)
}

func (p *StreamParser) resetBuf() {
	if cap(p.buf) > keepBuf {
		p.buf = nil
	} else {
		p.buf = p.buf[:0]
	}
}

// dispatch ends the current event.
func (p *StreamParser) dispatch() bool {
	lines, over := p.dataLines, p.oversized
	p.dataLines, p.oversized = 0, false
	defer p.resetBuf()
	switch {
	case lines == 0:
		return false
	case over:
		p.events++
		p.oversizedN++
		return false
	case len(p.buf) == 0:
		return false
	}
	p.events++
	return p.handle(p.buf)
}

// handle reads one event's data.
func (p *StreamParser) handle(data []byte) bool {
	if string(bytes.TrimSpace(data)) == "[DONE]" {
		p.done = true
		return false
	}
	if firstByte(data) != '{' || !wellFormed(data) {
		p.malformed++
		return false
	}
	first := false
	each(gjson.Parse(view(data)), func(k string, v gjson.Result) bool {
		switch k {
		case "usage":
			if v.IsObject() {
				p.usage, p.hasUsage = readUsage(v), true
			}
		case "choices":
			if !p.content && v.IsArray() && hasContent(v) {
				p.content, first = true, true
			}
		case "error":
			if v.Type != gjson.Null {
				p.failed = true
			}
		case "object":
			if v.Str == "error" {
				p.failed = true
			}
		}
		return true
	})
	return first
}

// hasContent reports whether a choices array carries generated content.
func hasContent(choices gjson.Result) bool {
	found := false
	each(choices, func(_ string, ch gjson.Result) bool {
		if !ch.IsObject() {
			return true
		}
		each(ch, func(k string, v gjson.Result) bool {
			switch k {
			case "text":
				found = v.Type == gjson.String && v.Str != ""
			case "delta":
				found = v.IsObject() && deltaHasContent(v)
			}
			return !found
		})
		return !found
	})
	return found
}

func deltaHasContent(delta gjson.Result) bool {
	found := false
	each(delta, func(k string, v gjson.Result) bool {
		switch k {
		case "content", "reasoning_content", "reasoning":
			found = v.Type == gjson.String && v.Str != ""
		case "tool_calls":
			found = v.Type != gjson.Null && !(v.IsArray() && emptyArray(v.Raw))
		}
		return !found
	})
	return found
}

// Usage returns the usage of the last event that had a non-null "usage"
// object: the final usage chunk that vLLM and SGLang send when the request
// set stream_options.include_usage. ok is false when no event had one.
func (p *StreamParser) Usage() (u Usage, ok bool) {
	if !p.hasUsage {
		return unreported(), false
	}
	return p.usage, true
}

// Done reports whether the stream's "data: [DONE]" event was seen.
func (p *StreamParser) Done() bool { return p.done }

// Failed reports whether an event carried an error (a non-null "error"
// member, or "object": "error"): the worker failed after it had sent a
// 200 status.
func (p *StreamParser) Failed() bool { return p.failed }

// Events returns the number of events seen, including [DONE], malformed
// and oversized ones.
func (p *StreamParser) Events() int { return p.events }

// Oversized returns the number of events skipped for being larger than the
// limit.
func (p *StreamParser) Oversized() int { return p.oversizedN }

// Malformed returns the number of events skipped because their data was
// neither [DONE] nor a JSON object.
func (p *StreamParser) Malformed() int { return p.malformed }
