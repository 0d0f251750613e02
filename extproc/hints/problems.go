package hints

import (
	"strconv"
	"strings"
)

// MaxProblemFields is how many field names Problems keeps.
const MaxProblemFields = 4

// Problems describes the hint values that Parse ignored because they were
// invalid, for a metric and a debug log. The zero value means none.
type Problems struct {
	// Count is the number of ignored values.
	Count int
	// fields holds the first MaxProblemFields distinct names.
	fields [MaxProblemFields]string
	n      int
}

func (p *Problems) add(name string) {
	p.Count++
	for _, f := range p.fields[:p.n] {
		if f == name {
			return
		}
	}
	if p.n < MaxProblemFields {
		p.fields[p.n] = name
		p.n++
	}
}

// Fields returns the names of the first ignored values (at most
// MaxProblemFields, each once): a header name such as "x-prefix-osl",
// "nvext.agent_hints.<field>", "nvext.annotations:<key>", or an nvext name
// from openai.NVExt.Ignored.
func (p Problems) Fields() []string {
	return append([]string(nil), p.fields[:p.n]...)
}

// String returns "" when there are no problems, else the count and the
// field names, such as "2 ignored hint values: x-prefix-osl, nvext.agent_hints.iat".
func (p Problems) String() string {
	if p.Count == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(strconv.Itoa(p.Count))
	if p.Count == 1 {
		b.WriteString(" ignored hint value: ")
	} else {
		b.WriteString(" ignored hint values: ")
	}
	b.WriteString(strings.Join(p.fields[:p.n], ", "))
	if p.Count > p.n {
		b.WriteString(", ...")
	}
	return b.String()
}
